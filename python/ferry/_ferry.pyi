"""Type stubs for ferry._ferry, the compiled part of the ferry package."""

from __future__ import annotations

import ctypes
import enum
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, SupportsIndex, Union

__version__: str

_Int = SupportsIndex
_Message = Union[bytes, bytearray, memoryview, str]
_Offsets = Union[Sequence[SupportsIndex], Any]  # a sequence, or a 1-D int64/uint64 numpy array
_Timeout = Optional[float]  # milliseconds; None = no limit
_Bytes = Union[bytes, bytearray, memoryview]

class TransferError(RuntimeError):
    """A setup call failed for a reason other than its arguments (a backend that does not
    load or start, a closed engine, a session that cannot be served)."""

    code: Optional[StatusCode]

class InvalidArgumentError(ValueError):
    """Bad arguments; code is StatusCode.ERR_INVALID_ARGS."""

    code: Optional[StatusCode]

class NotFoundError(LookupError):
    """A memory region, engine or backend that is not registered; code is ERR_NOT_FOUND."""

    code: Optional[StatusCode]

class StatusCode(enum.IntEnum):
    """Outcome codes (MORI-IO's plus ERR_TIMEOUT, ERR_TRANSPORT); errors are > 10.
    Compares with ints as well."""

    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15
    ERR_TIMEOUT = 16
    ERR_TRANSPORT = 17
    ERR_OUTCOME_UNKNOWN = 18
    ERR_CANCELLED = 19
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class MemoryLocationType(enum.Enum):
    Unknown = 0
    CPU = 1
    GPU = 2
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class BackendType(enum.Enum):
    """Backends ferry ships plugins for; create_backend() also takes 'tcp', 'rdma',
    'xgmi', 'ofi' or any plugin name."""

    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    OFI = 4
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class IOEngineConfig:
    """host: address the control listener binds and advertises; port: 0 = any free port;
    node_id: empty = FERRY_NODE_ID, boot id, hostname; policy_file: empty = FERRY_POLICY,
    then the built-in policy; plugin_dirs: searched after FERRY_PLUGIN_PATH;
    timeout_ms: per-transfer deadline, 0 = the policy's; auth_token: shared secret every
    peer must prove (empty: FERRY_AUTH_TOKEN, then none)."""

    host: str
    port: int
    node_id: str
    policy_file: str
    plugin_dirs: List[str]
    timeout_ms: int
    auth_token: str
    metrics_address: str
    etcd_endpoints: List[str]
    etcd_namespace: str
    etcd_lease_ms: int
    stats_socket: str
    notify: Optional[bool]
    inbound_max_per_peer: int
    inbound_max_age_ms: int
    control_idle_close_ms: int
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: _Int = 0,
        node_id: str = "",
        policy_file: str = "",
        plugin_dirs: List[str] = ...,
        timeout_ms: _Int = 0,
        auth_token: str = "",
        stats_socket: str = "",
        metrics_address: str = "",
        etcd_endpoints: List[str] = ...,
        etcd_namespace: str = "",
        etcd_lease_ms: _Int = 0,
    ) -> None: ...

class EngineDesc:
    """Everything a peer needs to reach an engine; read-only."""

    @property
    def key(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def node_id(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def backends(self) -> Dict[str, bytes]: ...
    def pack(self) -> bytes: ...
    @staticmethod
    def unpack(data: _Bytes) -> EngineDesc:
        """Raises InvalidArgumentError (a ValueError) on a truncated or forged blob."""
    def to_json(self) -> str: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

class MemoryDesc:
    """A registered memory region; read-only."""

    @property
    def engine_key(self) -> str: ...
    @property
    def id(self) -> int: ...
    @property
    def location(self) -> MemoryLocationType: ...
    @property
    def device(self) -> int: ...
    @property
    def device_id(self) -> int: ...
    @property
    def bus_id(self) -> str: ...
    @property
    def addr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def backends(self) -> Dict[str, bytes]: ...
    def pack(self) -> bytes: ...
    @staticmethod
    def unpack(data: _Bytes) -> MemoryDesc: ...
    def to_json(self) -> str: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

class TransferStatus:
    """One transfer's state, shared by every copy; the first final code sticks."""

    def __init__(self) -> None: ...
    def Code(self) -> StatusCode: ...
    def Message(self) -> str: ...
    def Init(self) -> bool: ...
    def InProgress(self) -> bool: ...
    def Succeeded(self) -> bool: ...
    def Failed(self) -> bool: ...
    def Wait(self) -> StatusCode:
        """Block (GIL released) until the transfer ends; returns its code."""
    def WaitFor(self, timeout_ms: _Timeout) -> bool:
        """Block (GIL released) at most timeout_ms; True when the transfer has ended."""
    def Cancel(self) -> bool:
        """End it ERR_CANCELLED once nothing more can land; False if it had already ended."""
    def ElapsedUs(self) -> int:
        """Microseconds from the post to the end (to now while it has not ended)."""

class IOEngineSession:
    """Transfers between one local and one remote region, resolved once."""

    def allocate_transfer_uid(self) -> int: ...
    def read(self, local_offset: _Int, remote_offset: _Int, size: _Int, transfer_uid: _Int,
             notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def write(self, local_offset: _Int, remote_offset: _Int, size: _Int, transfer_uid: _Int,
              notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def batch_read(self, local_offsets: _Offsets, remote_offsets: _Offsets, sizes: _Offsets,
                   transfer_uid: _Int, notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def batch_write(self, local_offsets: _Offsets, remote_offsets: _Offsets, sizes: _Offsets,
                    transfer_uid: _Int, notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def alive(self) -> bool: ...

_BackendArg = Union[BackendType, str]
_BackendConfigArg = Union[None, str, Mapping[str, Any], Any]  # Any: has to_dict()

class PreparedList:
    def __len__(self) -> int: ...
    @property
    def local(self) -> bool: ...
    @property
    def engine_key(self) -> str: ...

class IOEngine:
    """One engine per process; a context manager (close() on exit)."""

    def __init__(self, key: str, config: Optional[IOEngineConfig] = None) -> None: ...
    @property
    def key(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> IOEngine: ...
    def __exit__(self, *args: Any) -> None: ...
    def get_engine_desc(self) -> EngineDesc: ...
    def create_backend(self, type: _BackendArg, config: _BackendConfigArg = None) -> None:
        """Raises TransferError when the plugin cannot load or start,
        InvalidArgumentError (ValueError) for bad settings."""
    def remove_backend(self, type: _BackendArg) -> None: ...
    def backends(self) -> List[str]: ...
    def register_remote_engine(self, engine_desc: Union[EngineDesc, _Bytes]) -> None: ...
    def deregister_remote_engine(self, engine_desc: Union[EngineDesc, str]) -> None: ...
    def register_memory(
        self,
        ptr: Union[int, ctypes.c_void_p, Any],
        size: _Int,
        device_id: int = -1,
        mem_loc: Union[MemoryLocationType, str] = MemoryLocationType.Unknown,
    ) -> MemoryDesc: ...
    def register_buffer(self, obj: Any) -> MemoryDesc:
        """A writable, C-contiguous buffer (numpy, bytearray, mmap, memoryview); kept
        alive (and its export held) until deregister_memory() or close()."""
    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        """A contiguous torch.Tensor (CPU or CUDA) or an object with
        __cuda_array_interface__; kept alive until deregister_memory() or close()."""
    def deregister_memory(self, mem_desc: MemoryDesc) -> None: ...
    def allocate_transfer_uid(self) -> int: ...
    def read(self, local_mem: MemoryDesc, local_offset: _Int, remote_mem: MemoryDesc,
             remote_offset: _Int, size: _Int, transfer_uid: _Int,
             notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def write(self, local_mem: MemoryDesc, local_offset: _Int, remote_mem: MemoryDesc,
              remote_offset: _Int, size: _Int, transfer_uid: _Int,
              notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def batch_read(self, local_mem: MemoryDesc, local_offsets: _Offsets, remote_mem: MemoryDesc,
                   remote_offsets: _Offsets, sizes: _Offsets, transfer_uid: _Int,
                   notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def batch_write(self, local_mem: MemoryDesc, local_offsets: _Offsets, remote_mem: MemoryDesc,
                    remote_offsets: _Offsets, sizes: _Offsets, transfer_uid: _Int,
                    notify: Optional[bool] = None,
             message: Optional[_Message] = None) -> TransferStatus: ...
    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc, *,
                       raise_on_failure: bool = False) -> Optional[IOEngineSession]: ...
    def pop_inbound_transfer_status(self, remote_key: str,
                                    transfer_uid: _Int) -> Optional[TransferStatus]: ...
    def wait_inbound(self, remote_key: str, transfer_uid: _Int,
                     timeout_ms: _Timeout = None) -> Optional[TransferStatus]: ...
    def transfer(self, op: str, local_mems: Sequence[MemoryDesc], remote_mems: Sequence[MemoryDesc],
                 items: Any, transfer_uid: _Int, notify: Optional[bool] = None,
                 message: Optional[_Message] = None) -> TransferStatus: ...
    def prepare_list(self, mems: Sequence[MemoryDesc], entries: Any) -> PreparedList: ...
    def transfer_prepared(self, op: str, local_list: PreparedList, local_indices: _Offsets,
                          remote_list: PreparedList, remote_indices: _Offsets, transfer_uid: _Int,
                          notify: Optional[bool] = None,
                          message: Optional[_Message] = None) -> TransferStatus: ...
    def send_notification(self, remote_key: str, message: _Message) -> TransferStatus: ...
    def get_new_notifications(self) -> Dict[str, List[bytes]]: ...
    def wait_notifications(self, timeout_ms: Optional[_Int] = None) -> Dict[str, List[bytes]]: ...
    def notification_fd(self) -> int: ...
    def stats(self) -> Dict[str, Any]: ...
    def policy_source(self) -> str: ...
    def metrics_address(self) -> str: ...
    def publish_memory(self, name: str, mem: MemoryDesc) -> None: ...
    def unpublish_memory(self, name: str) -> None: ...
    def fetch_remote_engine(self, key: str, wait_ms: _Int = 0) -> None: ...
    def fetch_memory(self, key: str, name: str, wait_ms: _Int = 0) -> MemoryDesc: ...
    @staticmethod
    def wait_all(statuses: Sequence[TransferStatus], timeout_ms: _Timeout = None) -> bool: ...

def wait_all(statuses: Sequence[TransferStatus], timeout_ms: _Timeout = None) -> bool: ...
def set_log_level(level: str) -> None:
    """'error', 'warn', 'info' or 'debug'; ValueError otherwise."""
def list_plugins(extra_dirs: List[str] = ...) -> List[Dict[str, Any]]: ...
