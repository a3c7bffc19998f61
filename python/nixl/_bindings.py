# SPDX-License-Identifier: Apache-2.0
"""nixl._bindings over ferry: NIXL's exception classes, status and memory-type
constants, descriptor lists and the telemetry record, as the connectors import them.
"""

import enum

import numpy as np

NIXL_INIT_AGENT = ""
DEFAULT_COMM_PORT = 8888

# Status values (nixl_types.h).
NIXL_IN_PROG = 1
NIXL_SUCCESS = 0
NIXL_ERR_NOT_POSTED = -1
NIXL_ERR_INVALID_PARAM = -2
NIXL_ERR_BACKEND = -3
NIXL_ERR_NOT_FOUND = -4
NIXL_ERR_MISMATCH = -5
NIXL_ERR_NOT_ALLOWED = -6
NIXL_ERR_REPOST_ACTIVE = -7
NIXL_ERR_UNKNOWN = -8
NIXL_ERR_NOT_SUPPORTED = -9
NIXL_ERR_REMOTE_DISCONNECT = -10
NIXL_ERR_CANCELED = -11
NIXL_ERR_NO_TELEMETRY = -12


class _NixlError(Exception):
    """str(e) starts with NIXL's status name (what connectors match), then ferry's reason."""

    status_name = "NIXL_ERR_UNKNOWN"
    status = NIXL_ERR_UNKNOWN

    def __init__(self, detail=""):
        super().__init__(f"{self.status_name}: {detail}" if detail else self.status_name)


def _error(name, status_name, status):
    return type(name, (_NixlError,), {"status_name": status_name, "status": status,
                                      "__module__": __name__})


nixlNotPostedError = _error("nixlNotPostedError", "NIXL_ERR_NOT_POSTED", NIXL_ERR_NOT_POSTED)
nixlInvalidParamError = _error("nixlInvalidParamError", "NIXL_ERR_INVALID_PARAM",
                               NIXL_ERR_INVALID_PARAM)
nixlBackendError = _error("nixlBackendError", "NIXL_ERR_BACKEND", NIXL_ERR_BACKEND)
nixlNotFoundError = _error("nixlNotFoundError", "NIXL_ERR_NOT_FOUND", NIXL_ERR_NOT_FOUND)
nixlMismatchError = _error("nixlMismatchError", "NIXL_ERR_MISMATCH", NIXL_ERR_MISMATCH)
nixlNotAllowedError = _error("nixlNotAllowedError", "NIXL_ERR_NOT_ALLOWED", NIXL_ERR_NOT_ALLOWED)
nixlRepostActiveError = _error("nixlRepostActiveError", "NIXL_ERR_REPOST_ACTIVE",
                               NIXL_ERR_REPOST_ACTIVE)
nixlUnknownError = _error("nixlUnknownError", "NIXL_ERR_UNKNOWN", NIXL_ERR_UNKNOWN)
nixlNotSupportedError = _error("nixlNotSupportedError", "NIXL_ERR_NOT_SUPPORTED",
                               NIXL_ERR_NOT_SUPPORTED)
nixlRemoteDisconnectError = _error("nixlRemoteDisconnectError", "NIXL_ERR_REMOTE_DISCONNECT",
                                   NIXL_ERR_REMOTE_DISCONNECT)
nixlCancelledError = _error("nixlCancelledError", "NIXL_ERR_CANCELED", NIXL_ERR_CANCELED)
nixlNoTelemetryError = _error("nixlNoTelemetryError", "NIXL_ERR_NO_TELEMETRY",
                              NIXL_ERR_NO_TELEMETRY)


class nixl_mem_t(enum.IntEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG,
                                                  nixl_mem_t.BLK_SEG, nixl_mem_t.OBJ_SEG,
                                                  nixl_mem_t.FILE_SEG)


class nixl_xfer_op_t(enum.IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


NIXL_READ, NIXL_WRITE = nixl_xfer_op_t.NIXL_READ, nixl_xfer_op_t.NIXL_WRITE


class nixlXferTelemetry:
    """One finished transfer: startTime (us since the epoch), postDuration and
    xferDuration (us, from the post to the end), totalBytes, descCount."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime, self.postDuration, self.xferDuration = startTime, postDuration, xferDuration
        self.totalBytes, self.descCount = totalBytes, descCount

    def __repr__(self):
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
                f"descCount={self.descCount})")


def _rows(data, width, what):
    """(N, 3) uint64 rows of (addr, len, dev) from a C-contiguous Nx3 int64/uint64 array
    or a list of tuples; metadata strings (the 4th tuple field) apart."""
    if isinstance(data, np.ndarray):
        if data.ndim != 2 or data.shape[1] != 3:
            raise ValueError(f"{what}: a numpy array must have shape (N, 3), got {data.shape}")
        if data.dtype not in (np.uint64, np.int64) or not data.flags.c_contiguous:
            raise ValueError(f"{what}: a numpy array must be C-contiguous uint64 or int64")
        if data.dtype == np.int64 and (data < 0).any():
            raise ValueError(f"{what}: negative address, length or device")
        return data.astype(np.uint64, copy=False), [""] * len(data)
    rows, metas = [], []
    for i, t in enumerate(data):
        if len(t) != width:
            raise ValueError(f"{what}: descriptor {i} has {len(t)} fields, {width} expected")
        a, n, d = int(t[0]), int(t[1]), int(t[2])
        if a < 0 or n < 0 or d < 0:
            raise ValueError(f"{what}: descriptor {i} has a negative field")
        rows.append((a, n, d))
        metas.append(str(t[3]) if width == 4 else "")
    arr = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    return arr, metas


class _DList:
    """A descriptor list: (addr, len, dev) rows of one memory type. No __len__, so it is
    always truthy, as NIXL's (connectors test `if not descs`)."""

    _width = 3

    def __init__(self, type, descs=None, *args):
        self._type = nixl_mem_t(int(type))
        if descs is None or isinstance(descs, int):
            self._rows, self._metas = np.zeros((0, 3), dtype=np.uint64), []
        else:
            self._rows, self._metas = _rows(descs, self._width, self.__class__.__name__)

    def getType(self):
        return self._type

    def descCount(self):
        return len(self._rows)

    def isEmpty(self):
        return len(self._rows) == 0

    def __getitem__(self, i):
        a, n, d = (int(x) for x in self._rows[i])
        return (a, n, d, self._metas[i]) if self._width == 4 else (a, n, d)

    def addDesc(self, desc):
        rows, metas = _rows([desc], self._width, self.__class__.__name__)
        self._rows = np.concatenate([self._rows, rows])
        self._metas += metas

    append = addDesc

    def clear(self):
        self._rows, self._metas = np.zeros((0, 3), dtype=np.uint64), []

    def __eq__(self, other):
        return (type(self) is type(other) and self._type == other._type
                and np.array_equal(self._rows, other._rows) and self._metas == other._metas)

    __hash__ = None

    def __repr__(self):
        return f"<{self.__class__.__name__} {self._type.name} {len(self._rows)} descriptors>"


class nixlXferDList(_DList):
    """Transfer descriptors: (addr, len, dev) triples."""


class nixlRegDList(_DList):
    """Registration descriptors: (addr, len, dev, meta) 4-tuples (an Nx3 array: meta '')."""

    _width = 4

    def __init__(self, type, descs=None, *args):
        super().__init__(type, descs, *args)
        self._mems = []  # the ferry regions, once register_memory registered them

    def trim(self):
        return self
