# SPDX-License-Identifier: Apache-2.0
"""nixl._api over ferry: nixl_agent with NIXL's semantics, as vLLM's NixlConnector
and SGLang's nixl backend call it (docs/connectors.md).

An agent is a ferry engine whose key is the agent name. Its metadata
(get_agent_metadata) is the engine's descriptor and every region registered so
far; a peer addresses remote memory by (addr, len, dev) inside those regions, and
prep_xfer_dlist resolves each descriptor to (region, offset) once. Transfers are
ferry's prepared-list transfers; a notification message goes to the remote agent
once the data is there (a WRITE's at the target, a READ's back here).
"""

import enum
import logging
import os
import socket
import struct
import threading
import time

import numpy as np

import ferry

from . import _bindings as B
from ._bindings import (  # noqa: F401  (NIXL exports these from _api too)
    DEFAULT_COMM_PORT,
    nixlRegDList,
    nixlXferDList,
    nixlXferTelemetry,
)

log = logging.getLogger("nixl")

nixl_backend_handle = int


class nixl_thread_sync_t(enum.Enum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


class nixl_agent_config:
    """NIXL's agent options. backends: NIXL backend names ('UCX', 'LIBFABRIC') or ferry
    plugin names; capture_telemetry enables get_xfer_telemetry. The progress thread,
    listener, port, thread count and sync mode have no ferry counterpart (ferry's
    engine always progresses on its own threads and is thread-safe)."""

    def __init__(self, enable_prog_thread=True, enable_listen_thread=False,
                 listen_port=DEFAULT_COMM_PORT, capture_telemetry=False, num_threads=0,
                 backends=None, sync_mode=None):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError("sync_mode must be a nixl_thread_sync_t or None")
        self.backends = ["UCX"] if backends is None else list(backends)
        self.enable_pthread = bool(enable_prog_thread)
        self.enable_listen = bool(enable_listen_thread)
        self.port = int(listen_port)
        self.capture_telemetry = bool(capture_telemetry)
        self.num_threads = int(num_threads)
        self.sync_mode = sync_mode


# ---- backends ----------------------------------------------------------------------

def _ucx_plugins():
    """The ferry plugins a NIXL 'UCX' backend starts (FERRY_NIXL_UCX overrides): UCX is
    NIXL's general transport, so every general one ferry has that starts here; the
    policy ranks them per peer and memory type."""
    env = os.environ.get("FERRY_NIXL_UCX")
    if env:
        return [p.strip() for p in env.split(",") if p.strip()], True
    return ["xgmi", "rdma", "tcp"], False


_NIXL_NAMES = {"UCX": None, "LIBFABRIC": ["ofi"]}
_MEM_TYPES = {"DRAM": B.DRAM_SEG, "VRAM": B.VRAM_SEG, "cpu": B.DRAM_SEG, "cuda": B.VRAM_SEG,
              "BLOCK": B.BLK_SEG, "OBJ": B.OBJ_SEG, "FILE": B.FILE_SEG}
_OPS = {"READ": "read", "WRITE": "write"}


def _loaded_plugins():
    return {p["name"] for p in ferry.list_plugins() if p["loaded"]}


def _name(agent):
    """Agent names arrive as str or as the bytes add_remote_agent returned."""
    if isinstance(agent, (bytes, bytearray)):
        return bytes(agent).decode()
    if isinstance(agent, str):
        return agent
    raise TypeError(f"agent name must be str or bytes, got {type(agent).__name__}")


def _message(m):
    if m is None:
        return b""
    if isinstance(m, str):
        return m.encode()
    return bytes(m)


_FERRY_TO_NIXL = {
    ferry.StatusCode.ERR_INVALID_ARGS: B.nixlInvalidParamError,
    ferry.StatusCode.ERR_NOT_FOUND: B.nixlNotFoundError,
    ferry.StatusCode.ERR_RDMA_OP: B.nixlBackendError,
    ferry.StatusCode.ERR_BAD_STATE: B.nixlBackendError,
    ferry.StatusCode.ERR_GPU_OP: B.nixlBackendError,
    ferry.StatusCode.ERR_TIMEOUT: B.nixlRemoteDisconnectError,
    ferry.StatusCode.ERR_TRANSPORT: B.nixlRemoteDisconnectError,
    ferry.StatusCode.ERR_OUTCOME_UNKNOWN: B.nixlRemoteDisconnectError,
    ferry.StatusCode.ERR_CANCELLED: B.nixlCancelledError,
}


_RUNNING = (ferry.StatusCode.INIT, ferry.StatusCode.IN_PROGRESS)


def _state(status):
    """'DONE', 'PROC', or the NIXL error of a failed transfer raised (one read of the code:
    a transfer ending between two reads must not look failed). A poll first: it drives the
    backend once (a tcp transfer that post() queued leaves now, responses are read)."""
    status.WaitFor(0)
    code = status.Code()
    if code == ferry.StatusCode.SUCCESS:
        return "DONE"
    if code in _RUNNING:
        return "PROC"
    _raise_for(status, code)


def _raise_for(status, code):
    raise _FERRY_TO_NIXL.get(code, B.nixlUnknownError)(f"{code.name}: {status.Message()}")


def _from_ferry_error(e):
    if isinstance(e, ferry.NotFoundError):
        return B.nixlNotFoundError(str(e))
    if isinstance(e, (ferry.InvalidArgumentError, ValueError)):
        return B.nixlInvalidParamError(str(e))
    return B.nixlBackendError(str(e))


# ---- metadata: the engine descriptor and every registered region --------------------

_MD_MAGIC = b"FERRYNIXL1"


def _pack_metadata(engine_desc, mems):
    out = [_MD_MAGIC, struct.pack("<I", len(engine_desc)), engine_desc, struct.pack("<I", len(mems))]
    for m in mems:
        p = m.pack()
        out += [struct.pack("<I", len(p)), p]
    return b"".join(out)


def _unpack_metadata(md):
    md = bytes(md)
    if not md.startswith(_MD_MAGIC):
        raise B.nixlInvalidParamError("add_remote_agent: not a ferry nixl agent's metadata")
    pos = len(_MD_MAGIC)

    def take():
        nonlocal pos
        if pos + 4 > len(md):
            raise B.nixlInvalidParamError("add_remote_agent: truncated metadata")
        (n,) = struct.unpack_from("<I", md, pos)
        if pos + 4 + n > len(md):
            raise B.nixlInvalidParamError("add_remote_agent: truncated metadata")
        pos += 4 + n
        return md[pos - n:pos]

    try:
        desc = ferry.EngineDesc.unpack(take())
        if pos + 4 > len(md):
            raise B.nixlInvalidParamError("add_remote_agent: truncated metadata")
        (count,) = struct.unpack_from("<I", md, pos)
        pos += 4
        if count > (len(md) - pos) // 4:
            raise B.nixlInvalidParamError("add_remote_agent: region count beyond the metadata")
        mems = [ferry.MemoryDesc.unpack(take()) for _ in range(count)]
    except ferry.InvalidArgumentError as e:
        raise B.nixlInvalidParamError(f"add_remote_agent: {e}") from None
    if pos != len(md):
        raise B.nixlInvalidParamError("add_remote_agent: trailing bytes after the metadata")
    for m in mems:
        if m.engine_key != desc.key:
            raise B.nixlInvalidParamError("add_remote_agent: a region of another engine")
    return desc, mems


class _Regions:
    """Registered regions of one agent, found by address: (addr, len, dev) -> (region, offset)."""

    def __init__(self, mems):
        self.mems = list(mems)
        order = sorted(range(len(self.mems)), key=lambda i: self.mems[i].addr)
        self.mems = [self.mems[i] for i in order]
        self.starts = np.array([m.addr for m in self.mems], dtype=np.uint64)
        self.ends = self.starts + np.array([m.size for m in self.mems], dtype=np.uint64)
        self.gpu = np.array([m.location == ferry.MemoryLocationType.GPU for m in self.mems],
                            dtype=bool)
        self.dev = np.array([max(m.device, 0) for m in self.mems], dtype=np.int64)

    def resolve(self, rows, mem_type, who):
        """An (N, 3) int64 array of (region index, offset, size), or nixlNotFoundError
        naming the first descriptor outside every region of mem_type on its device."""
        want_gpu = mem_type == B.VRAM_SEG
        n = len(rows)
        if n == 0:
            return np.zeros((0, 3), dtype=np.int64)
        addr, size, dev = rows[:, 0], rows[:, 1], rows[:, 2].astype(np.int64)
        idx = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        ok = idx >= 0
        j = np.where(ok, idx, 0)
        if len(self.mems):
            # No addr + size: a forged size would wrap around 2**64.
            end = self.ends[j]
            inside = addr <= end
            room = np.where(inside, end - np.where(inside, addr, end), 0)
            ok &= inside & (size <= room) & (self.gpu[j] == want_gpu)
            if want_gpu:
                ok &= self.dev[j] == dev
        else:
            ok[:] = False
        for i in np.flatnonzero(~ok):  # overlapping registrations: look at every region
            a, s, d = int(addr[i]), int(size[i]), int(dev[i])
            for k, m in enumerate(self.mems):
                if (m.addr <= a and a + s <= m.addr + m.size
                        and (m.location == ferry.MemoryLocationType.GPU) == want_gpu
                        and (not want_gpu or m.device == d)):
                    j[i], ok[i] = k, True
                    break
            else:
                raise B.nixlNotFoundError(
                    f"descriptor {i} (addr 0x{a:x}, len {s}, dev {d}) is not inside a "
                    f"{mem_type.name} region {who} registered")
        out = np.empty((n, 3), dtype=np.int64)
        out[:, 0] = j
        out[:, 1] = (addr - self.starts[j]).astype(np.int64)
        out[:, 2] = size.astype(np.int64)
        return out


class _RemoteAgent:
    __slots__ = ("desc", "regions")

    def __init__(self, desc, mems):
        self.desc, self.regions = desc, _Regions(mems)


# ---- handles -------------------------------------------------------------------------

class nixl_prepped_dlist_handle:
    """A prepared descriptor list (prep_xfer_dlist); indices in make_prepped_xfer are
    positions in it. Released by release_dlist_handle or when collected."""

    def __init__(self, agent, remote, plist, rows, mem_type):
        self._agent, self.remote, self._plist = agent, remote, plist
        self._rows, self.mem_type, self._released = rows, mem_type, False

    @property
    def local(self):
        return self.remote is None

    def release(self):
        self._released, self._plist = True, None

    def __del__(self):
        self._released = True


class nixl_xfer_handle:
    """One transfer request (make_prepped_xfer / initialize_xfer), posted by transfer()."""

    def __init__(self, agent, op, local, lidx, remote, ridx, notif, owned=()):
        self._agent, self.op = agent, op
        self._local, self._lidx, self._remote, self._ridx = local, lidx, remote, ridx
        self.notif, self._owned = notif, list(owned)
        self._status, self._released = None, False
        self._start_us = self._post_us = 0
        sizes = local._rows[lidx, 1]
        self.total_bytes = int(sizes.sum())
        self.desc_count = self._merged_count()

    def _merged_count(self):
        # NIXL merges consecutive pairs contiguous on both sides; telemetry counts after it.
        la = self._local._rows[self._lidx, 0]
        ra = self._remote._rows[self._ridx, 0]
        n = self._local._rows[self._lidx, 1]
        if len(la) < 2:
            return len(la)
        joins = (la[1:] == la[:-1] + n[:-1]) & (ra[1:] == ra[:-1] + n[:-1])
        return int(len(la) - joins.sum())

    def release(self):
        if self._released:
            return
        st = self._status
        if st is not None and st.InProgress():
            st.Cancel()  # ends ERR_CANCELLED once nothing more of it can land
        self._released = True
        for h in self._owned:
            h.release()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001  (an engine already closed)
            pass


# ---- the agent ---------------------------------------------------------------------------

def _route_source_address():
    """This host's address on its default route, or None (no route: a sandbox).

    A UDP socket's connect() only picks the route and its source address; it
    sends nothing. 192.0.2.1 is a documentation address (TEST-NET-1), never a
    real peer."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            addr = s.getsockname()[0]
            return None if addr.startswith("127.") or addr == "0.0.0.0" else addr
    except OSError:
        return None


def _engine_host():
    # ferry binds and advertises one address, which peers on other nodes must
    # reach: the one the application names (vLLM gives its side channel's, SGLang
    # its node's), else the address of the default route - NIXL's UCX metadata
    # carries the node's real address too, and SGLang's nixl backend names none -
    # else loopback.
    for var in ("FERRY_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST", "SGLANG_HOST_IP", "HOST_IP"):
        v = os.environ.get(var, "").strip().strip("[]")
        if v:
            return v
    return _route_source_address() or "127.0.0.1"


class nixl_agent:
    """nixl_agent(agent_name, nixl_conf=None, instantiate_all=False)."""

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
        if not isinstance(agent_name, str) or not agent_name:
            raise ValueError("agent_name must be a non-empty str")
        conf = nixl_conf if nixl_conf is not None else nixl_agent_config()
        if nixl_conf is not None and instantiate_all:
            log.warning("nixl: instantiate_all is ignored when a config is given")
        self.name = agent_name
        self._conf = conf
        self._lock = threading.RLock()
        self._eng = ferry.IOEngine(agent_name, ferry.IOEngineConfig(host=_engine_host(), port=0))
        self.backends = {}       # NIXL backend name -> handle
        self._plugins = {}       # NIXL backend name -> ferry plugins started for it
        self._local = []         # ferry MemoryDescs registered here
        self._local_regions = _Regions([])
        self._remotes = {}       # agent name -> _RemoteAgent
        self._pending_notifs = []
        self.notifs = {}
        self.nixl_mems = dict(_MEM_TYPES)
        self.nixl_ops = {"READ": B.NIXL_READ, "WRITE": B.NIXL_WRITE}
        self.plugin_list = self.get_plugin_list()
        if not self.plugin_list:
            raise RuntimeError("No plugins available for NIXL (ferry found no loadable plugin: "
                               "FERRY_PLUGIN_PATH)")
        wanted = self.plugin_list if (nixl_conf is None and instantiate_all) else conf.backends
        for b in wanted:
            if b not in self.plugin_list:
                log.warning("nixl: backend %s is not available; skipped", b)
                continue
            self.create_backend(b)

    # ---- plugins and backends -------------------------------------------------------------
    def get_plugin_list(self):
        loaded = _loaded_plugins()
        out = []
        if "tcp" in loaded or "rdma" in loaded:
            out.append("UCX")
        if "ofi" in loaded:
            out.append("LIBFABRIC")
        return out + sorted(loaded)

    def get_plugin_params(self, backend):
        return {}

    def get_plugin_mem_types(self, backend):
        return ["DRAM", "VRAM"] if backend in self.get_plugin_list() else []

    def get_backend_params(self, backend):
        return {}

    def get_backend_mem_types(self, backend):
        return ["DRAM", "VRAM"] if backend in self.backends else []

    def create_backend(self, backend, initParams=None):
        """Start the ferry plugins behind a NIXL backend name ('UCX': xgmi, rdma and tcp,
        those that start here; 'LIBFABRIC': ofi; a ferry plugin name: that plugin).
        initParams (NIXL's str -> str) have no ferry meaning and are logged at debug;
        'ferry_settings' (a JSON string) goes to the plugin(s) as their settings."""
        params = dict(initParams or {})
        settings = params.pop("ferry_settings", None)
        for k, v in params.items():
            log.debug("nixl: backend %s parameter %s=%r has no ferry counterpart; ignored",
                      backend, k, v)
        with self._lock:
            if backend in self.backends:
                return
        if backend == "UCX":
            names, strict = _ucx_plugins()
        elif backend in _NIXL_NAMES:
            names, strict = _NIXL_NAMES[backend], True
        elif backend in _loaded_plugins():
            names, strict = [backend], True
        else:
            raise B.nixlNotFoundError(f"create_backend: no ferry plugin serves backend "
                                      f"'{backend}' (available: {self.get_plugin_list()})")
        started, why = [], []
        for p in names:
            if p in self._eng.backends():
                started.append(p)
                continue
            try:
                self._eng.create_backend(p, settings)
                started.append(p)
            except (ferry.TransferError, ValueError) as e:
                if strict:
                    raise B.nixlBackendError(f"create_backend {backend}: {p}: {e}") from None
                why.append(f"{p}: {e}")
                log.debug("nixl: %s without %s: %s", backend, p, e)
        if not started:
            raise B.nixlBackendError(f"create_backend {backend}: no ferry plugin started "
                                     f"({'; '.join(why)})")
        with self._lock:
            self.backends[backend] = len(self.backends) + 1
            self._plugins[backend] = started

    # ---- descriptors ----------------------------------------------------------------------
    def _mem_type(self, mem_type):
        if isinstance(mem_type, B.nixl_mem_t):
            return mem_type
        if mem_type not in self.nixl_mems:
            raise KeyError(mem_type)
        return self.nixl_mems[mem_type]

    def _dlist(self, cls, descs, mem_type, what):
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, B._DList):
            log.error("nixl: %s: a %s where a %s is expected", what, type(descs).__name__,
                      cls.__name__)
            return None
        if hasattr(descs, "data_ptr"):
            descs = [descs]
        if isinstance(descs, (list, tuple)) and descs and hasattr(descs[0], "data_ptr"):
            return self._tensor_dlist(cls, descs)
        if mem_type is None:
            log.error("nixl: %s: mem_type is required for tuples or arrays", what)
            return None
        mt = self._mem_type(mem_type)
        try:
            return cls(mt, descs)
        except ValueError:
            if isinstance(descs, np.ndarray):
                raise
            log.error("nixl: %s: wrong descriptor shape", what)
            return None

    @staticmethod
    def _tensor_dlist(cls, tensors):
        dev = tensors[0].get_device()
        rows = []
        for t in tensors:
            if not t.is_contiguous() or t.get_device() != dev:
                log.error("nixl: tensors must be contiguous and on one device")
                return None
            r = (t.data_ptr(), t.numel() * t.element_size(), max(dev, 0))
            rows.append(r + ("",) if cls is nixlRegDList else r)
        return cls(B.DRAM_SEG if dev == -1 else B.VRAM_SEG, rows)

    def get_reg_descs(self, descs, mem_type=None):
        return self._dlist(nixlRegDList, descs, mem_type, "get_reg_descs")

    def get_xfer_descs(self, descs, mem_type=None):
        return self._dlist(nixlXferDList, descs, mem_type, "get_xfer_descs")

    # ---- registration -----------------------------------------------------------------------
    def register_memory(self, reg_list, mem_type=None, backends=None):
        for b in backends or []:
            self.backends[b]  # KeyError for a backend never created, as NIXL
        dl = self.get_reg_descs(reg_list, mem_type)
        if dl is None:
            raise B.nixlInvalidParamError("register_memory: descriptors not understood")
        if dl._type not in (B.DRAM_SEG, B.VRAM_SEG):
            raise B.nixlNotSupportedError(f"register_memory: {dl._type.name} (ferry moves "
                                          "DRAM and VRAM)")
        gpu = dl._type == B.VRAM_SEG
        done = []
        try:
            for a, n, d in dl._rows.tolist():
                done.append(self._eng.register_memory(
                    a, n, d if gpu else -1,
                    ferry.MemoryLocationType.GPU if gpu else ferry.MemoryLocationType.CPU))
        except (ferry.TransferError, ValueError, LookupError) as e:
            for m in done:
                self._eng.deregister_memory(m)
            raise _from_ferry_error(e) from None
        dl._mems = done
        with self._lock:
            self._local += done
            self._local_regions = _Regions(self._local)
        return dl

    def deregister_memory(self, dereg_list, backends=None):
        mems = list(getattr(dereg_list, "_mems", []) or [])
        if not mems:  # a list describing registered ranges: find them
            rows = {tuple(r) for r in dereg_list._rows.tolist()}
            mems = [m for m in self._local if (m.addr, m.size, max(m.device, 0)) in rows]
        with self._lock:
            ids = {m.id for m in mems}
            self._local = [m for m in self._local if m.id not in ids]
            self._local_regions = _Regions(self._local)
        for m in mems:
            try:
                self._eng.deregister_memory(m)
            except ferry.NotFoundError:
                pass
        if hasattr(dereg_list, "_mems"):
            dereg_list._mems = []

    def query_memory(self, reg_list, backend, mem_type=None):
        dl = self.get_reg_descs(reg_list, mem_type)
        return [None for _ in range(dl.descCount())] if dl is not None else []

    # ---- metadata and remote agents ---------------------------------------------------------
    def get_agent_metadata(self):
        with self._lock:
            mems = list(self._local)
        return _pack_metadata(self._eng.get_engine_desc().pack(), mems)

    def get_partial_agent_metadata(self, descs=None, inc_conn_info=False, backends=None):
        return self.get_agent_metadata()  # a superset add_remote_agent takes the same way

    def add_remote_agent(self, metadata):
        """Load a peer's metadata; returns its name as bytes (as NIXL's binding does)."""
        desc, mems = _unpack_metadata(metadata)
        if desc.key == self.name:
            raise B.nixlNotAllowedError("add_remote_agent: this agent's own metadata")
        try:
            self._eng.register_remote_engine(desc)
        except (ferry.TransferError, ValueError) as e:
            raise _from_ferry_error(e) from None
        with self._lock:
            self._remotes[desc.key] = _RemoteAgent(desc, mems)
        return desc.key.encode()

    def remove_remote_agent(self, agent):
        name = _name(agent)
        with self._lock:
            known = self._remotes.pop(name, None)
        if known is None:
            return  # NIXL: a silent no-op
        try:
            self._eng.deregister_remote_engine(name)
        except ferry.NotFoundError:
            pass

    def check_remote_metadata(self, remote_name, descs=None):
        name = _name(remote_name)
        with self._lock:
            r = self._remotes.get(name)
        if r is None:
            return False
        if descs is None:
            return True
        try:
            r.regions.resolve(descs._rows, descs._type, f"agent '{name}'")
            return True
        except B.nixlNotFoundError:
            return False

    def make_connection(self, remote_agent, backends=None):
        if _name(remote_agent) not in self._remotes:
            raise B.nixlNotFoundError(f"make_connection: agent '{_name(remote_agent)}' unknown")
        # ferry connects on the first transfer; nothing to warm up here.

    def send_local_metadata(self, ip_addr="", port=DEFAULT_COMM_PORT):
        raise B.nixlNotSupportedError("send_local_metadata: exchange get_agent_metadata() "
                                      "bytes out of band (ferry has no NIXL listener)")

    def fetch_remote_metadata(self, remote_agent, ip_addr="", port=DEFAULT_COMM_PORT, label=""):
        raise B.nixlNotSupportedError("fetch_remote_metadata: exchange get_agent_metadata() "
                                      "bytes out of band (ferry has no NIXL listener)")

    invalidate_local_metadata = send_local_metadata
    send_partial_agent_metadata = send_local_metadata

    # ---- prepared lists and transfers -----------------------------------------------------
    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=None):
        """'' or 'NIXL_INIT_AGENT': descriptors of this agent's registered memory; a peer's
        name (str or bytes): of that peer's. Each descriptor must lie inside one region."""
        name = _name(agent_name)
        dl = self.get_xfer_descs(xfer_list, mem_type)
        if dl is None:
            raise B.nixlInvalidParamError("prep_xfer_dlist: descriptors not understood")
        local = name in ("", "NIXL_INIT_AGENT")
        with self._lock:
            if local:
                regions, remote, who = self._local_regions, None, "this agent"
            elif name == self.name:
                raise B.nixlNotSupportedError("prep_xfer_dlist: loopback (this agent's own "
                                              "name) is not supported; use 'NIXL_INIT_AGENT'")
            elif name in self._remotes:
                regions, remote, who = self._remotes[name].regions, name, f"agent '{name}'"
            else:
                raise B.nixlNotFoundError(f"prep_xfer_dlist: no metadata for agent '{name}' "
                                          "(add_remote_agent first)")
        entries = regions.resolve(dl._rows, dl._type, who)
        try:
            plist = self._eng.prepare_list(regions.mems, entries)
        except (ferry.TransferError, ValueError, LookupError) as e:
            raise _from_ferry_error(e) from None
        return nixl_prepped_dlist_handle(self, remote, plist, dl._rows, dl._type)

    def release_dlist_handle(self, handle):
        handle.release()

    @staticmethod
    def _indices(v, n, what):
        idx = np.ascontiguousarray(np.asarray(v).ravel())
        if idx.size and not np.issubdtype(idx.dtype, np.integer):
            raise B.nixlInvalidParamError(f"{what}: integer indices expected")
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise B.nixlInvalidParamError(f"{what}: an index outside the list's {n} entries")
        return idx

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side,
                          remote_indices, notif_msg=b"", backends=None, skip_desc_merge=False):
        op = _OPS[operation]  # KeyError for another operation, as NIXL
        ls, rs = local_xfer_side, remote_xfer_side
        if ls._released or rs._released:
            raise B.nixlInvalidParamError("make_prepped_xfer: a released list handle")
        if not ls.local or rs.local:
            raise B.nixlInvalidParamError("make_prepped_xfer: the local side must be a local "
                                          "list and the remote side a peer's")
        if rs.remote not in self._remotes:
            raise B.nixlNotFoundError(f"make_prepped_xfer: agent '{rs.remote}' was removed")
        li = self._indices(local_indices, len(ls._rows), "local_indices")
        ri = self._indices(remote_indices, len(rs._rows), "remote_indices")
        if len(li) == 0 or len(li) != len(ri):
            raise B.nixlInvalidParamError(f"make_prepped_xfer: {len(li)} local and {len(ri)} "
                                          "remote indices (equal and non-zero needed)")
        if (ls._rows[li, 1] != rs._rows[ri, 1]).any():
            k = int(np.flatnonzero(ls._rows[li, 1] != rs._rows[ri, 1])[0])
            raise B.nixlInvalidParamError(f"make_prepped_xfer: pair {k} differs in length "
                                          f"({ls._rows[li[k], 1]} vs {rs._rows[ri[k], 1]})")
        return nixl_xfer_handle(self, op, ls, li, rs, ri, _message(notif_msg))

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"",
                        backends=None):
        local = self.prep_xfer_dlist("", local_descs)
        remote = self.prep_xfer_dlist(remote_agent, remote_descs)
        n = len(local._rows)
        if n != len(remote._rows):
            raise B.nixlInvalidParamError(f"initialize_xfer: {n} local and {len(remote._rows)} "
                                          "remote descriptors")
        h = self.make_prepped_xfer(operation, local, np.arange(n), remote, np.arange(n), notif_msg)
        h._owned = [local, remote]
        return h

    def transfer(self, handle, notif_msg=b""):
        """Post the request; 'DONE' or 'PROC' (an error raises, as NIXL's binding does)."""
        if handle._released:
            raise B.nixlInvalidParamError("transfer: a released handle")
        st = handle._status
        if st is not None and st.InProgress():
            raise B.nixlRepostActiveError("transfer: still in progress")
        if handle._remote._released or handle._local._released:
            raise B.nixlInvalidParamError("transfer: a list handle it was built from was released")
        if handle._remote.remote not in self._remotes:
            raise B.nixlNotFoundError(f"transfer: agent '{handle._remote.remote}' was removed")
        msg = _message(notif_msg) or handle.notif
        handle._start_us = time.time_ns() // 1000
        t0 = time.perf_counter_ns()
        st = self._eng.transfer_prepared(handle.op, handle._local._plist, handle._lidx,
                                         handle._remote._plist, handle._ridx,
                                         self._eng.allocate_transfer_uid(), notify=False,
                                         message=msg or None)
        handle._post_us = (time.perf_counter_ns() - t0) // 1000
        handle._status = st
        return _state(st)

    def check_xfer_state(self, handle):
        st = handle._status
        if st is None:
            raise B.nixlNotPostedError("check_xfer_state: the request was never posted")
        return _state(st)

    def get_xfer_telemetry(self, handle):
        if not self._conf.capture_telemetry:
            raise B.nixlNoTelemetryError("capture_telemetry is off in nixl_agent_config")
        st = handle._status
        if st is None:
            raise B.nixlNotPostedError("get_xfer_telemetry: never posted")
        if _state(st) == "PROC":
            return None
        return B.nixlXferTelemetry(handle._start_us, handle._post_us, st.ElapsedUs(),
                                   handle.total_bytes, handle.desc_count)

    def query_xfer_backend(self, handle):
        return "UCX" if "UCX" in self.backends else next(iter(self.backends), "")

    def estimate_xfer_cost(self, handle):
        raise B.nixlNotSupportedError("estimate_xfer_cost")

    def release_xfer_handle(self, handle):
        """Release it; one still in progress is cancelled (ferry's Cancel: it ends
        ERR_CANCELLED once nothing more of it can land)."""
        handle.release()

    # ---- notifications ----------------------------------------------------------------------
    def _reap_notifs(self):
        # send_notif does not wait; a message that was not taken is reported here.
        ended, running = [], []
        with self._lock:
            for n, st in self._pending_notifs:
                (running if st.InProgress() else ended).append((n, st))
            self._pending_notifs = running
        for name, st in ended:
            if st.Failed():
                log.warning("nixl: a notification to '%s' was not delivered: %s", name,
                            st.Message())

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        """A message to a remote agent (its metadata loaded); it arrives once, in order."""
        name = _name(remote_agent_name)
        if name not in self._remotes:
            raise B.nixlNotFoundError(f"send_notif: no metadata for agent '{name}'")
        st = self._eng.send_notification(name, _message(notif_msg))
        _state(st)  # raises for a message refused at once
        self._reap_notifs()
        with self._lock:
            self._pending_notifs.append((name, st))

    def get_new_notifs(self, backends=None):
        """{sender agent name: [message bytes, in arrival order]} since the last call."""
        self._reap_notifs()
        return self._eng.get_new_notifications()

    def update_notifs(self, backends=None):
        for k, v in self.get_new_notifs().items():
            self.notifs.setdefault(k, []).extend(v)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=None,
                               tag_is_prefix=True):
        self.update_notifs()
        msgs = self.notifs.get(_name(remote_agent_name), [])
        for i, m in enumerate(msgs):
            # NIXL: a prefix, or else anywhere in the message (a substring).
            if (m.startswith(lookup_tag) if tag_is_prefix else lookup_tag in m):
                del msgs[i]
                return True
        return False

    # ---- ferry extensions ---------------------------------------------------------------------
    @property
    def ferry_engine(self):
        """The ferry.IOEngine underneath (stats(), policy)."""
        return self._eng
