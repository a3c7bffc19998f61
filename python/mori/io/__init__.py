# SPDX-License-Identifier: Apache-2.0
"""mori.io over ferry: MORI-IO's engine API, as vLLM's MoRIIOConnector and SGLang's
mori backend call it (docs/connectors.md has the name table and what differs).

    from mori.io import IOEngine, IOEngineConfig, BackendType, RdmaBackendConfig, PollCqMode
    engine = IOEngine("prefill-0", IOEngineConfig("10.0.0.1", 0))
    engine.create_backend(BackendType.RDMA,
                          RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, enable_notification=False))
"""

from .. import cpp as _cpp
from ..cpp import *  # noqa: F401,F403  (mori.io re-exports mori.cpp's types, as MORI-IO does)
from .engine import IOEngine, IOEngineSession  # noqa: F401

__all__ = sorted(set(_cpp.__all__) - {"TransferStatus"} | {"IOEngine", "IOEngineSession"})
