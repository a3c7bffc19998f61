# SPDX-License-Identifier: Apache-2.0
"""ferry: one-sided READ/WRITE between the registered memory of two processes.

The API follows MORI-IO's ``mori.io`` (docs/python.md); the drop-in packages ``mori``
and ``nixl`` serve MORI-IO's and NIXL's exact APIs over it (docs/connectors.md)::

    import ferry
    eng = ferry.IOEngine("prefill-0", ferry.IOEngineConfig(host="10.0.0.1", port=0))
    eng.create_backend(ferry.BackendType.TCP)          # or "tcp", or {"lanes": 8} settings
    mem = eng.register_buffer(numpy_array)             # or register_torch_tensor(t)
    eng.register_remote_engine(ferry.EngineDesc.unpack(peer_desc_bytes))
    st = eng.write(mem, 0, ferry.MemoryDesc.unpack(peer_mem_bytes), 0, n, eng.allocate_transfer_uid())
    if st.Wait() != ferry.StatusCode.SUCCESS:
        print(st.Message())

The compiled part is ``ferry._ferry``; this file re-exports it and adds the
backend-config helpers MORI-IO users construct (RdmaBackendConfig, ...).
"""

import enum as _enum

try:
    # Measured on the GPU host (torch 2.11 wheels, Python 3.12): loading _ferry before numpy
    # made a later `import torch` abort (free(): invalid pointer); numpy first, or torch
    # first, did not. Not root-caused (docs/connectors.md); numpy is cheap and always there
    # where tensors are.
    import numpy as _numpy  # noqa: F401
except ImportError:
    pass

from ._ferry import (  # noqa: F401  (re-exported API)
    BackendType,
    EngineDesc,
    InvalidArgumentError,
    IOEngine,
    IOEngineConfig,
    IOEngineSession,
    MemoryDesc,
    MemoryLocationType,
    NotFoundError,
    PreparedList,
    StatusCode,
    TransferError,
    TransferStatus,
    list_plugins,
    set_log_level,
    wait_all,
)

try:
    from ._ferry import __version__  # noqa: F401
except ImportError:  # built without a version
    __version__ = "0"

# Shorter aliases.
MemoryLocation = MemoryLocationType

for _cls in (BackendType, EngineDesc, IOEngine, IOEngineConfig, IOEngineSession, MemoryDesc,
             MemoryLocationType, StatusCode, TransferStatus):
    _cls.__module__ = __name__


class PollCqMode(_enum.Enum):
    """RDMA completion polling (MORI-IO's PollCqMode); sent to the plugin as a string."""

    POLLING = "polling"
    EVENT = "event"


class BackendConfig:
    """Plugin settings as keyword arguments, handed to the plugin as a JSON object.

    Only the keys given are sent; the plugin (or the policy file) supplies the rest.
    ``create_backend`` also takes a plain dict or a JSON string.
    """

    backend = None  # the BackendType this config is meant for

    def __init__(self, **settings):
        for k, v in settings.items():
            if v is not None:
                setattr(self, k, v)

    def to_dict(self):
        out = {}
        for k, v in vars(self).items():
            if k.startswith("_"):
                continue
            if isinstance(v, _enum.Enum):
                v = v.value if isinstance(v.value, (str, int)) else v.name.lower()
            out[k] = v
        return out

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"{type(self).__name__}({args})"


class TcpBackendConfig(BackendConfig):
    """tcp plugin settings, e.g. ``lanes``, ``chunk_bytes``, ``listen_host``,
    ``advertise_host``, ``connect_timeout_ms``, ``io_timeout_ms`` (docs/backends/tcp.md)."""

    backend = BackendType.TCP


class RdmaBackendConfig(BackendConfig):
    """rdma plugin settings by ferry's names (docs/backends/rdma.md), e.g.
    ``qp_per_transfer``, ``chunk_bytes``, ``busy_poll``, ``devices``, ``gid_index``.
    MORI-IO's RdmaBackendConfig (its positional order, poll_cq_mode,
    enable_notification...) is ``mori.io.RdmaBackendConfig`` (docs/connectors.md)."""

    backend = BackendType.RDMA


class XgmiBackendConfig(BackendConfig):
    """xgmi plugin settings by ferry's names: ``num_streams`` (per device, 1..64),
    ``batch_copy``, ``spin_us`` (docs/backends/xgmi.md). MORI-IO's is
    ``mori.io.XgmiBackendConfig``."""

    backend = BackendType.XGMI


class OfiBackendConfig(BackendConfig):
    """ofi (libfabric) plugin settings, e.g. ``provider``."""

    backend = BackendType.OFI


__all__ = [
    "BackendConfig",
    "BackendType",
    "EngineDesc",
    "InvalidArgumentError",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocation",
    "MemoryLocationType",
    "NotFoundError",
    "OfiBackendConfig",
    "PollCqMode",
    "PreparedList",
    "RdmaBackendConfig",
    "StatusCode",
    "TcpBackendConfig",
    "TransferError",
    "TransferStatus",
    "XgmiBackendConfig",
    "list_plugins",
    "set_log_level",
    "wait_all",
]
