# SPDX-License-Identifier: Apache-2.0
"""MORI-IO's value types over ferry's: what mori.cpp exports.

Each class keeps MORI-IO's constructor order and defaults (the connectors pass
RdmaBackendConfig's first four or five arguments by position) and its attribute
names; the ferry object underneath is what the engine is handed.
"""

import enum
import logging
import socket
import struct

import ferry

log = logging.getLogger("mori.io")

# MORI-IO's codes are ferry's (ferry adds ERR_TIMEOUT .. ERR_CANCELLED after
# ERR_GPU_OP): the same enum, so codes compare equal across both packages.
StatusCode = ferry.StatusCode
MemoryLocationType = ferry.MemoryLocationType
_ERR_BEGIN = 10  # MORI-IO: a code above this is a failure


class BackendType(enum.IntEnum):
    """MORI-IO's backends; each is served by a ferry plugin (FABRIC by ofi)."""

    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class PollCqMode(enum.IntEnum):
    """MORI-IO's completion-queue polling modes (values as MORI-IO's)."""

    POLLING = 0
    EVENT = 1


def _int(name, v):
    if isinstance(v, bool) or not isinstance(v, int):
        # Also what MORI-IO's compiled constructor does with a wrong type.
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return v


def _bool(name, v):
    if not isinstance(v, (bool, int)):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return bool(v)


class IOEngineConfig:
    """IOEngineConfig(host="", port=0): where the engine listens for its peers.

    host "" means 127.0.0.1 (ferry binds and advertises one address; give the
    address peers reach). port 0 picks a free port, reported by
    get_engine_desc().port at once.
    """

    def __init__(self, host="", port=0):
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, got {type(host).__name__}")
        self.host = host
        self.port = _int("port", port)

    def _ferry(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        return ferry.IOEngineConfig(host=self.host or "127.0.0.1", port=self.port)

    def __repr__(self):
        return f"IOEngineConfig(host={self.host!r}, port={self.port})"


class RdmaBackendConfig:
    """MORI-IO's RDMA settings, in MORI-IO's argument order.

    Mapped onto ferry's rdma plugin: qp_per_transfer; chunk_bytes (when
    enable_transfer_chunking); max_send_wr, max_cqe_num (cq_size), max_msg_sge
    (max_sge) when set (> 0); poll_cq_mode EVENT sets busy_poll false (POLLING
    keeps ferry's default completion thread). enable_notification decides whether
    the target records inbound statuses (pop_inbound_transfer_status). The rest
    (post_batch_size, num_worker_threads, notif_per_qp, max_chunks_per_transfer,
    num_nics_per_transfer) has no ferry counterpart: accepted, logged at debug.
    """

    _IGNORED = ("post_batch_size", "num_worker_threads", "notif_per_qp",
                "max_chunks_per_transfer", "num_nics_per_transfer")

    def __init__(self, qp_per_transfer=1, post_batch_size=-1, num_worker_threads=-1,
                 poll_cq_mode=PollCqMode.POLLING, enable_notification=True, notif_per_qp=1024,
                 enable_transfer_chunking=False, chunk_bytes=65536, max_chunks_per_transfer=64,
                 num_nics_per_transfer=1):
        self.qp_per_transfer = _int("qp_per_transfer", qp_per_transfer)
        self.post_batch_size = _int("post_batch_size", post_batch_size)
        self.num_worker_threads = _int("num_worker_threads", num_worker_threads)
        self.poll_cq_mode = PollCqMode(poll_cq_mode)
        self.enable_notification = _bool("enable_notification", enable_notification)
        self.notif_per_qp = _int("notif_per_qp", notif_per_qp)
        self.enable_transfer_chunking = _bool("enable_transfer_chunking", enable_transfer_chunking)
        self.chunk_bytes = _int("chunk_bytes", chunk_bytes)
        self.max_chunks_per_transfer = _int("max_chunks_per_transfer", max_chunks_per_transfer)
        self.num_nics_per_transfer = _int("num_nics_per_transfer", num_nics_per_transfer)
        self.max_send_wr = 0
        self.max_cqe_num = 0
        self.max_msg_sge = 0

    def _ferry_settings(self):
        """The rdma plugin's settings this config stands for."""
        s = {}
        if self.qp_per_transfer > 0:
            s["qp_per_transfer"] = self.qp_per_transfer
        if self.enable_transfer_chunking:
            s["chunk_bytes"] = max(self.chunk_bytes, 4096)
        for mine, theirs in (("max_send_wr", "max_send_wr"), ("max_cqe_num", "cq_size"),
                             ("max_msg_sge", "max_sge")):
            if getattr(self, mine) > 0:
                s[theirs] = getattr(self, mine)
        if self.poll_cq_mode == PollCqMode.EVENT:
            s["busy_poll"] = False
        for k in self._IGNORED:
            log.debug("mori.io: RdmaBackendConfig.%s=%r has no ferry setting; ignored", k,
                      getattr(self, k))
        return s

    def __repr__(self):
        return (f"RdmaBackendConfig(qp_per_transfer={self.qp_per_transfer}, "
                f"poll_cq_mode={self.poll_cq_mode.name}, "
                f"enable_notification={self.enable_notification})")


class XgmiBackendConfig:
    """XgmiBackendConfig(num_streams=64, num_events=64): num_streams goes to ferry's
    xgmi plugin (streams per device); num_events has no counterpart (ignored)."""

    def __init__(self, num_streams=64, num_events=64):
        self.num_streams = _int("num_streams", num_streams)
        self.num_events = _int("num_events", num_events)

    def _ferry_settings(self):
        log.debug("mori.io: XgmiBackendConfig.num_events=%d has no ferry setting; ignored",
                  self.num_events)
        return {"num_streams": min(max(self.num_streams, 1), 64)}


class FabricBackendConfig(XgmiBackendConfig):
    """FabricBackendConfig(num_streams=64, num_events=64): FABRIC is served by ferry's
    ofi plugin, which has no stream settings (both accepted and ignored)."""

    def _ferry_settings(self):
        log.debug("mori.io: FabricBackendConfig fields have no ofi setting; ignored")
        return None


_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warn": "warn",
           "warning": "warn", "error": "error", "err": "error", "critical": "error",
           "off": "error"}


def set_log_level(level):
    """MORI-IO's log levels (trace, debug, info, warning, error, critical) for ferry's
    log and the 'mori.io' Python logger."""
    if not isinstance(level, str) or level.lower() not in _LEVELS:
        raise ValueError(f"set_log_level: unknown level {level!r} "
                         f"(one of {', '.join(sorted(_LEVELS))})")
    name = _LEVELS[level.lower()]
    ferry.set_log_level(name)
    log.setLevel({"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
                  "error": logging.ERROR}[name])


class TransferStatus:
    """A transfer's state with MORI-IO's semantics.

    A status a post returned is IN_PROGRESS until it ends (ferry's INIT, queued,
    reads as IN_PROGRESS: MORI-IO sets IN_PROGRESS inside the post), so
    ``not InProgress()`` means ended. ``TransferStatus()`` is a fresh INIT status
    as MORI-IO's; SetCode/SetMessage/Update set it (and override a posted one).
    """

    __slots__ = ("_st", "_code", "_msg")

    def __init__(self):
        self._st = None
        self._code = StatusCode.INIT
        self._msg = ""

    @classmethod
    def _of(cls, st):
        out = cls.__new__(cls)
        out._st, out._code, out._msg = st, None, None
        return out

    @classmethod
    def _failed(cls, code, msg):
        out = cls()
        out._code, out._msg = code, msg
        return out

    def Code(self):
        if self._code is not None:
            return self._code
        # A poll, as a MORI-IO status read: it drives the backend once (a tcp
        # transfer that post() queued leaves now).
        self._st.WaitFor(0)
        c = self._st.Code()
        return StatusCode.IN_PROGRESS if c == StatusCode.INIT else c

    def Message(self):
        return self._msg if self._msg is not None else self._st.Message()

    def Init(self):
        return self.Code() == StatusCode.INIT

    def InProgress(self):
        return self.Code() == StatusCode.IN_PROGRESS

    def Succeeded(self):
        return self.Code() == StatusCode.SUCCESS

    def Failed(self):
        return int(self.Code()) > _ERR_BEGIN

    def SetCode(self, code):
        self._code = StatusCode(int(code))

    def SetMessage(self, message):
        self._msg = str(message)

    def Update(self, code, message):
        if self.Failed():
            return  # as MORI-IO: a failure is final
        self._code, self._msg = StatusCode(int(code)), str(message)

    def Wait(self):
        """Block until the transfer ends (GIL released). Returns None, as MORI-IO's."""
        if self._st is not None and self._code is None:
            self._st.Wait()

    def WaitFor(self, timeout_ms=-1):
        """Block up to timeout_ms (-1: no limit, 0: poll); returns the StatusCode then."""
        if self.InProgress() and self._st is not None and self._code is None:
            self._st.WaitFor(None if timeout_ms < 0 else timeout_ms)
        return self.Code()

    # ferry extensions
    def Cancel(self):
        """End the transfer ERR_CANCELLED once nothing more can land (ferry's Cancel)."""
        return self._st.Cancel() if self._st is not None else False

    def __repr__(self):
        return f"<mori TransferStatus {self.Code().name}>"


_ENGINE_MAGIC = b"mfe1"  # mori-over-ferry EngineDesc: magic, hostname, ferry's packed desc


class EngineDesc:
    """An engine's descriptor: key, node_id, hostname, host, port, pid; pack()/unpack()."""

    __slots__ = ("_d", "hostname")

    def __init__(self):
        raise TypeError("EngineDesc has no constructor: IOEngine.get_engine_desc() or "
                        "EngineDesc.unpack(bytes)")

    @classmethod
    def _of(cls, d, hostname):
        out = object.__new__(cls)
        out._d, out.hostname = d, hostname
        return out

    key = property(lambda self: self._d.key)
    host = property(lambda self: self._d.host)
    port = property(lambda self: self._d.port)
    node_id = property(lambda self: self._d.node_id)
    pid = property(lambda self: self._d.pid)

    def pack(self):
        name = self.hostname.encode()
        return _ENGINE_MAGIC + struct.pack("<H", len(name)) + name + self._d.pack()

    @staticmethod
    def unpack(data):
        """Raises ValueError (ferry.InvalidArgumentError) for a blob that is not one."""
        data = bytes(data)
        if data[:4] == _ENGINE_MAGIC and len(data) >= 6:
            (n,) = struct.unpack_from("<H", data, 4)
            if 6 + n > len(data):
                raise ferry.InvalidArgumentError("EngineDesc.unpack: truncated host name")
            name = data[6:6 + n].decode(errors="replace")
            return EngineDesc._of(ferry.EngineDesc.unpack(data[6 + n:]), name)
        return EngineDesc._of(ferry.EngineDesc.unpack(data), "")  # ferry's own form

    def __eq__(self, other):
        return isinstance(other, EngineDesc) and self._d == other._d

    def __hash__(self):
        return hash((self.key, self.host, self.port, self.pid))

    def __repr__(self):
        return f"<mori EngineDesc '{self.key}' {self.host}:{self.port}>"


def local_engine_desc(d):
    return EngineDesc._of(d, socket.gethostname())


class MemoryDesc:
    """A registered region: engine_key, id, device_id (-1: CPU), device_bus_id,
    numa_node, data (the registered address), size, loc, ipc_handle; pack()/unpack().

    ``MemoryDesc()`` is an empty descriptor, as MORI-IO's (a transfer on it fails
    ERR_NOT_FOUND).
    """

    __slots__ = ("_m",)

    def __init__(self):
        self._m = None

    @classmethod
    def _of(cls, m):
        out = cls.__new__(cls)
        out._m = m
        return out

    def _get(self, name, empty):
        return empty if self._m is None else getattr(self._m, name)

    engine_key = property(lambda self: self._get("engine_key", ""))
    id = property(lambda self: self._get("id", 0))
    device_id = property(lambda self: self._get("device", -1))
    device_bus_id = property(lambda self: self._get("bus_id", ""))
    data = property(lambda self: self._get("addr", 0))
    size = property(lambda self: self._get("size", 0))
    loc = property(lambda self: self._get("location", MemoryLocationType.Unknown))
    numa_node = property(lambda self: -1)
    # ferry's backends keep their keys in the packed descriptor; there is no
    # separate IPC handle to show.
    ipc_handle = property(lambda self: b"")

    def pack(self):
        if self._m is None:
            raise ferry.InvalidArgumentError("MemoryDesc.pack: an empty descriptor")
        return self._m.pack()

    @staticmethod
    def unpack(data):
        return MemoryDesc._of(ferry.MemoryDesc.unpack(bytes(data)))

    def __eq__(self, other):
        return isinstance(other, MemoryDesc) and self._m == other._m

    def __hash__(self):
        return hash((self.engine_key, self.id))

    def __repr__(self):
        return f"<mori MemoryDesc '{self.engine_key}' #{self.id} {self.size} B>"
