# SPDX-License-Identifier: Apache-2.0
"""mori.io over ferry: MORI-IO's engine API, as vLLM's MoRIIOConnector and SGLang's
mori backend call it (docs/connectors.md has the name table and what differs).

    from mori.io import IOEngine, IOEngineConfig, BackendType, RdmaBackendConfig, PollCqMode
    engine = IOEngine("prefill-0", IOEngineConfig("10.0.0.1", 0))
    engine.create_backend(BackendType.RDMA,
                          RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, enable_notification=False))
"""

from ..cpp import (  # noqa: F401  (re-exported, as mori.io does)
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
from .engine import IOEngine, IOEngineSession  # noqa: F401

__all__ = [
    "BackendType",
    "EngineDesc",
    "FabricBackendConfig",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "XgmiBackendConfig",
    "set_log_level",
]
