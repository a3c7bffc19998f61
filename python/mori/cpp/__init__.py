# SPDX-License-Identifier: Apache-2.0
"""mori.cpp: the types MORI-IO's compiled module exports, over ferry.

Statuses, descriptors, enums and backend configs with MORI-IO's names, values,
constructor argument order, defaults and attributes. The engine itself is
mori.io.IOEngine.
"""

from ._types import (  # noqa: F401  (the module's API)
    BackendType,
    EngineDesc,
    FabricBackendConfig,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
    set_log_level,
)

__all__ = [
    "BackendType",
    "EngineDesc",
    "FabricBackendConfig",
    "IOEngineConfig",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TransferStatus",
    "XgmiBackendConfig",
    "set_log_level",
]
