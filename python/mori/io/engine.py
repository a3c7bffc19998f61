# SPDX-License-Identifier: Apache-2.0
"""mori.io.IOEngine and IOEngineSession over ferry.IOEngine.

MORI-IO's signatures (positional, as the connectors call them) and return types:
engine-level batch_read/batch_write take one list entry per transfer and return a
status per entry; wait_all returns a StatusCode. Transfers never raise for what
the engine checks (the status fails), as in MORI-IO.
"""

import logging
import os
import threading

import ferry

from ..cpp._types import (
    BackendType,
    EngineDesc,
    MemoryDesc,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
    local_engine_desc,
)

log = logging.getLogger("mori.io")

# BackendType -> the ferry plugin that serves it.
_PLUGIN = {BackendType.XGMI: "xgmi", BackendType.RDMA: "rdma", BackendType.TCP: "tcp",
           BackendType.FABRIC: "ofi"}


def _rdma_fallback_allowed():
    # MORI-IO itself serves RDMA by XGMI when no RDMA device is active (MORI_DISABLE_AUTO_XGMI
    # turns that off); ferry serves it by tcp, with a warning, unless told not to.
    return os.environ.get("FERRY_MORI_RDMA_FALLBACK", "1") not in ("0", "false", "no", "off")


def _unwrap_mem(m, what):
    if not isinstance(m, MemoryDesc):
        raise TypeError(f"{what} must be a mori.io.MemoryDesc, got {type(m).__name__}")
    return m._m


def _desc_key(d):
    if isinstance(d, EngineDesc):
        return d.key
    if isinstance(d, str):
        return d
    raise TypeError(f"engine_desc must be a mori.io.EngineDesc, got {type(d).__name__}")


def _wrap(st):
    return TransferStatus._of(st)


def _empty_mem_status():
    return TransferStatus._failed(StatusCode.ERR_NOT_FOUND, "an empty MemoryDesc (MemoryDesc())")


class IOEngineSession:
    """Transfers between one local and one remote region (IOEngine.create_session).
    Offsets are bytes into the two regions."""

    __slots__ = ("_s", "_notify")

    def __init__(self, session, notify):
        self._s, self._notify = session, notify

    def allocate_transfer_uid(self):
        return self._s.allocate_transfer_uid()

    def read(self, local_offset, remote_offset, size, transfer_uid):
        return _wrap(self._s.read(local_offset, remote_offset, size, transfer_uid, self._notify))

    def write(self, local_offset, remote_offset, size, transfer_uid):
        return _wrap(self._s.write(local_offset, remote_offset, size, transfer_uid, self._notify))

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid):
        """One status for the whole batch, as MORI-IO's session."""
        return _wrap(self._s.batch_read(local_offsets, remote_offsets, sizes, transfer_uid,
                                        self._notify))

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return _wrap(self._s.batch_write(local_offsets, remote_offsets, sizes, transfer_uid,
                                         self._notify))

    def alive(self):
        return self._s.alive()


class IOEngine:
    """IOEngine(key, config): one per process. Also a context manager (close())."""

    # vLLM annotates `list[IOEngine.Session]`.
    Session = IOEngineSession

    def __init__(self, key, config):
        self._eng = ferry.IOEngine(key, config._ferry())
        self._lock = threading.Lock()
        self._created = {}  # BackendType -> ferry plugin names started for it
        # MORI-IO's targets record inbound statuses unless a backend config said
        # enable_notification=False (both upstream connectors do).
        self._notify = True

    # ---- backends ------------------------------------------------------------------
    def create_backend(self, type, config=None):
        """BackendType.RDMA/XGMI/TCP/FABRIC with its config (None: MORI-IO's defaults).
        A type created twice is a warning and a no-op, as MORI-IO."""
        if isinstance(type, str):  # ferry extension: any plugin name
            return self._start(type, type, None)
        bt = BackendType(int(type))
        if bt not in _PLUGIN:
            raise NotImplementedError(f"create_backend: backend type {bt!r} is not supported")
        with self._lock:
            if bt in self._created:
                log.warning("mori.io: backend %s already created; ignored", bt.name)
                return
        if bt == BackendType.RDMA:
            cfg = RdmaBackendConfig() if config is None else config
            if not isinstance(cfg, RdmaBackendConfig):
                raise TypeError("create_backend(RDMA, config): config must be an RdmaBackendConfig")
            self._notify = cfg.enable_notification
            try:
                self._start(bt, "rdma", cfg._ferry_settings())
            except ferry.TransferError as e:
                if not _rdma_fallback_allowed():
                    raise
                log.warning("mori.io: ferry's rdma backend did not start (%s); BackendType.RDMA "
                            "is served by tcp (FERRY_MORI_RDMA_FALLBACK=0 makes this an error)", e)
                self._start(bt, "tcp", None)
            # MORI-IO also adds XGMI where GPU peer access works: intra-node GPU pairs go there.
            self._try_xgmi()
        elif bt == BackendType.XGMI:
            cfg = XgmiBackendConfig() if config is None else config
            self._start(bt, "xgmi", cfg._ferry_settings())
        elif bt == BackendType.FABRIC:
            self._start(bt, "ofi", config._ferry_settings() if config is not None else None)
        else:
            self._start(bt, "tcp", config)

    def _start(self, bt, plugin, settings):
        self._eng.create_backend(plugin, settings)
        with self._lock:
            self._created.setdefault(bt, []).append(plugin)

    def _try_xgmi(self):
        if "xgmi" in self._eng.backends():
            return
        try:
            self._eng.create_backend("xgmi")
        except (ferry.TransferError, ValueError) as e:
            log.debug("mori.io: no xgmi next to rdma: %s", e)
            return
        with self._lock:
            self._created.setdefault(BackendType.XGMI, []).append("xgmi")

    def remove_backend(self, type):
        bt = type if isinstance(type, str) else BackendType(int(type))
        with self._lock:
            names = self._created.pop(bt, [])
        for n in names:
            self._eng.remove_backend(n)

    # ---- peers and memory --------------------------------------------------------------
    def get_engine_desc(self):
        # Fresh each time: it lists the backends created so far.
        return local_engine_desc(self._eng.get_engine_desc())

    def register_remote_engine(self, engine_desc):
        if not isinstance(engine_desc, EngineDesc):
            raise TypeError("register_remote_engine: a mori.io.EngineDesc "
                            "(EngineDesc.unpack(packed))")
        self._eng.register_remote_engine(engine_desc._d)

    def deregister_remote_engine(self, engine_desc):
        try:
            self._eng.deregister_remote_engine(_desc_key(engine_desc))
        except ferry.NotFoundError:
            log.debug("mori.io: deregister_remote_engine: '%s' was not registered",
                      _desc_key(engine_desc))

    def register_memory(self, ptr, size, device_id, mem_loc):
        return MemoryDesc._of(self._eng.register_memory(ptr, size, device_id, mem_loc))

    def register_torch_tensor(self, tensor):
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        return MemoryDesc._of(self._eng.register_torch_tensor(tensor))

    def deregister_memory(self, mem_desc):
        self._eng.deregister_memory(_unwrap_mem(mem_desc, "mem_desc"))

    def allocate_transfer_uid(self):
        return self._eng.allocate_transfer_uid()

    # ---- transfers ---------------------------------------------------------------------
    def read(self, local_mem, local_offset, remote_mem, remote_offset, size, transfer_uid):
        return self._one(self._eng.read, local_mem, local_offset, remote_mem, remote_offset,
                         size, transfer_uid)

    def write(self, local_mem, local_offset, remote_mem, remote_offset, size, transfer_uid):
        return self._one(self._eng.write, local_mem, local_offset, remote_mem, remote_offset,
                         size, transfer_uid)

    def _one(self, post, local_mem, local_offset, remote_mem, remote_offset, size, uid):
        lm, rm = _unwrap_mem(local_mem, "local_mem"), _unwrap_mem(remote_mem, "remote_mem")
        if lm is None or rm is None:
            return _empty_mem_status()
        return _wrap(post(lm, local_offset, rm, remote_offset, size, uid, self._notify))

    def batch_read(self, local_mems, local_offsets, remote_mems, remote_offsets, sizes,
                   transfer_uids):
        """Entry i: a batch of len(sizes[i]) pieces between local_mems[i] and remote_mems[i]
        under transfer_uids[i]. Returns one TransferStatus per entry."""
        return self._batch(self._eng.batch_read, local_mems, local_offsets, remote_mems,
                           remote_offsets, sizes, transfer_uids)

    def batch_write(self, local_mems, local_offsets, remote_mems, remote_offsets, sizes,
                    transfer_uids):
        return self._batch(self._eng.batch_write, local_mems, local_offsets, remote_mems,
                           remote_offsets, sizes, transfer_uids)

    def _batch(self, post, local_mems, local_offsets, remote_mems, remote_offsets, sizes, uids):
        n = len(sizes)
        lens = [len(local_mems), len(local_offsets), len(remote_mems), len(remote_offsets),
                len(uids)]
        if any(x != n for x in lens):
            msg = (f"batch: the six lists differ in length (sizes {n}, local_mems {lens[0]}, "
                   f"local_offsets {lens[1]}, remote_mems {lens[2]}, remote_offsets {lens[3]}, "
                   f"transfer_uids {lens[4]})")
            return [TransferStatus._failed(StatusCode.ERR_INVALID_ARGS, msg)
                    for _ in range(max([n] + lens))]
        out = []
        for i in range(n):
            lm = _unwrap_mem(local_mems[i], f"local_mems[{i}]")
            rm = _unwrap_mem(remote_mems[i], f"remote_mems[{i}]")
            if lm is None or rm is None:
                out.append(_empty_mem_status())
                continue
            out.append(_wrap(post(lm, local_offsets[i], rm, remote_offsets[i], sizes[i], uids[i],
                                  self._notify)))
        return out

    def create_session(self, local_mem, remote_mem):
        """An IOEngineSession, or None when no backend can serve the pair."""
        lm, rm = _unwrap_mem(local_mem, "local_mem"), _unwrap_mem(remote_mem, "remote_mem")
        if lm is None or rm is None:
            return None
        s = self._eng.create_session(lm, rm)
        return None if s is None else IOEngineSession(s, self._notify)

    def pop_inbound_transfer_status(self, remote_key, transfer_uid):
        st = self._eng.pop_inbound_transfer_status(remote_key, transfer_uid)
        return None if st is None else _wrap(st)

    def wait_all(self, statuses, timeout_ms=-1):
        """MORI-IO's wait_all: SUCCESS when every status succeeded; the first other final
        code (INIT counts as one) in list order; IN_PROGRESS when timeout_ms (0: poll)
        passed first. GIL released while waiting."""
        if not statuses:
            return StatusCode.SUCCESS
        inner = [s._st for s in statuses if s._st is not None and s._code is None]
        if timeout_ms != 0 and inner:
            ferry.wait_all(inner, None if timeout_ms < 0 else timeout_ms)
        first_bad = None
        for s in statuses:
            c = s.Code()
            if c == StatusCode.IN_PROGRESS:
                # A deadline that passed reports an earlier failure first; a poll does not.
                return first_bad if timeout_ms > 0 and first_bad is not None else c
            if c != StatusCode.SUCCESS and first_bad is None:
                first_bad = c
        return StatusCode.SUCCESS if first_bad is None else first_bad

    # ---- ferry extensions ------------------------------------------------------------------
    @property
    def ferry_engine(self):
        """The ferry.IOEngine underneath (stats(), notifications, prepared lists)."""
        return self._eng

    def close(self):
        self._eng.close()

    def __enter__(self):
        return self

    def __exit__(self, *args):
        self.close()
