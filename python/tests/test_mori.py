# SPDX-License-Identifier: Apache-2.0
"""The `mori` drop-in: MORI-IO's names, argument order, defaults, return types and
semantics, over ferry (in one process; test_connectors.py runs the connectors' sequences
in two)."""
import logging
import os

import numpy as np
import pytest

import ferry
from conftest import pattern, plugin_available, torch_or_skip

from mori.cpp import TransferStatus
from mori.io import (BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc,
                     MemoryLocationType, PollCqMode, RdmaBackendConfig, StatusCode,
                     XgmiBackendConfig, set_log_level)

SIZE = 1 << 20


def test_enum_values_are_mori_io():
    assert [(c.name, int(c)) for c in BackendType] == [
        ("Unknown", 0), ("XGMI", 1), ("RDMA", 2), ("TCP", 3), ("FABRIC", 4)]
    assert (int(PollCqMode.POLLING), int(PollCqMode.EVENT)) == (0, 1)
    assert PollCqMode.POLLING.name == "POLLING"
    codes = {"SUCCESS": 0, "INIT": 1, "IN_PROGRESS": 2, "ERR_INVALID_ARGS": 11,
             "ERR_NOT_FOUND": 12, "ERR_RDMA_OP": 13, "ERR_BAD_STATE": 14, "ERR_GPU_OP": 15}
    for name, v in codes.items():
        assert int(getattr(StatusCode, name)) == v
    assert int(MemoryLocationType.CPU) == 1 and int(MemoryLocationType.GPU) == 2


def test_rdma_config_takes_mori_positional_order():
    c = RdmaBackendConfig(4, 16, 2, PollCqMode.EVENT, False)  # SGLang's five positional
    assert (c.qp_per_transfer, c.post_batch_size, c.num_worker_threads) == (4, 16, 2)
    assert c.poll_cq_mode == PollCqMode.EVENT and c.enable_notification is False
    d = RdmaBackendConfig()
    assert (d.qp_per_transfer, d.post_batch_size, d.num_worker_threads, d.enable_notification,
            d.notif_per_qp, d.enable_transfer_chunking, d.chunk_bytes,
            d.max_chunks_per_transfer, d.num_nics_per_transfer) == (1, -1, -1, True, 1024, False,
                                                                    65536, 64, 1)
    assert (d.max_send_wr, d.max_cqe_num, d.max_msg_sge) == (0, 0, 0)
    full = RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, True, 8, True, 1 << 20, 4, 2)
    assert full._ferry_settings() == {"qp_per_transfer": 1, "chunk_bytes": 1 << 20}
    assert c._ferry_settings() == {"qp_per_transfer": 4, "busy_poll": False}
    d.max_send_wr, d.max_cqe_num = 512, 4096
    assert d._ferry_settings() == {"qp_per_transfer": 1, "max_send_wr": 512, "cq_size": 4096}
    with pytest.raises(TypeError):
        RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, True, 8, True, 1, 4, 2, 99)
    with pytest.raises(TypeError):
        RdmaBackendConfig("1")
    assert XgmiBackendConfig()._ferry_settings() == {"num_streams": 64}


def test_fresh_status_is_init_and_wait_for_returns_a_code():
    st = TransferStatus()
    assert st.Code() == StatusCode.INIT and st.Init() and not st.InProgress()
    assert not st.Failed() and not st.Succeeded()
    assert st.WaitFor() == StatusCode.INIT  # not in progress: at once
    assert st.Wait() is None
    st.Update(StatusCode.ERR_RDMA_OP, "SQ full")
    assert st.Failed() and "SQ full" in st.Message()
    st.Update(StatusCode.SUCCESS, "later")  # a failure is final
    assert st.Code() == StatusCode.ERR_RDMA_OP
    st.SetCode(StatusCode.IN_PROGRESS)
    assert st.InProgress()


def test_set_log_level():
    set_log_level("info")
    set_log_level("warning")
    with pytest.raises(ValueError):
        set_log_level("loud")


@pytest.fixture
def pair():
    engines = [IOEngine(k, IOEngineConfig("127.0.0.1", 0)) for k in ("mori-i", "mori-t")]
    yield engines
    for e in engines:
        e.close()


def rdma_config(notify):
    return RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, enable_notification=notify)


def connect(pair, notify=False):
    init, target = pair
    for e in pair:
        e.create_backend(BackendType.RDMA, rdma_config(notify))  # tcp serves it without a device
    assert target.get_engine_desc().port > 0
    init.register_remote_engine(EngineDesc.unpack(target.get_engine_desc().pack()))
    src, dst = np.frombuffer(pattern(SIZE, 3).tobytes(), np.uint8).copy(), np.zeros(SIZE, np.uint8)
    lm = init.register_memory(src.ctypes.data, SIZE, -1, MemoryLocationType.CPU)
    rm = MemoryDesc.unpack(target.register_memory(dst.ctypes.data, SIZE, -1,
                                                  MemoryLocationType.CPU).pack())
    return src, dst, lm, rm


def test_descriptors(pair):
    src, dst, lm, rm = connect(pair)
    assert lm.data == src.ctypes.data and lm.size == SIZE and lm.loc == MemoryLocationType.CPU
    assert lm.device_id == -1 and lm.engine_key == "mori-i" and isinstance(lm.pack(), bytes)
    assert MemoryDesc.unpack(lm.pack()) == lm
    d = pair[1].get_engine_desc()
    packed = d.pack()
    assert isinstance(packed, bytes)
    back = EngineDesc.unpack(packed)
    assert back == d and back.hostname == d.hostname and back.key == "mori-t"
    assert back.port == d.port and back.pid == os.getpid() and back.node_id == d.node_id
    assert EngineDesc.unpack(ferry.EngineDesc.unpack(packed[6 + len(d.hostname):]).pack()).key \
        == "mori-t"
    for bad in (packed[:5], packed[:6] + b"x", packed[:-3], b"\x00" * 40):
        with pytest.raises(ValueError):
            EngineDesc.unpack(bad)
    with pytest.raises(TypeError):
        EngineDesc()
    empty = MemoryDesc()
    assert empty.size == 0 and empty.engine_key == ""
    st = pair[0].write(empty, 0, rm, 0, 8, 1)
    assert st.Code() == StatusCode.ERR_NOT_FOUND


def test_engine_batch_is_list_form_with_a_status_each(pair):
    init, _ = pair
    src, dst, lm, rm = connect(pair)
    uids = [init.allocate_transfer_uid() for _ in range(3)]
    sts = init.batch_write([lm, lm, lm], [[0, 4096], [8192], [SIZE - 8]], [rm, rm, rm],
                           [[65536, 0], [100000], [SIZE]], [[4096, 4096], [512], [8]], uids)
    assert isinstance(sts, list) and len(sts) == 3
    assert not any(s.Init() for s in sts)  # posted: in progress or ended, never INIT
    assert init.wait_all(sts[:2]) == StatusCode.SUCCESS
    assert sts[2].WaitFor(-1) == StatusCode.ERR_INVALID_ARGS  # beyond the region
    assert init.wait_all(sts) == StatusCode.ERR_INVALID_ARGS
    assert np.array_equal(dst[65536:65536 + 4096], src[:4096])
    assert np.array_equal(dst[:4096], src[4096:8192])
    assert np.array_equal(dst[100000:100512], src[8192:8704])
    assert not dst[SIZE - 8:].any()
    bad = init.batch_write([lm], [[0], [0]], [rm], [[0]], [[8]], [1])
    assert all(s.Code() == StatusCode.ERR_INVALID_ARGS for s in bad) and len(bad) == 2
    assert init.wait_all([]) == StatusCode.SUCCESS


def test_wait_all_poll_and_deadline():
    running = TransferStatus()
    running.SetCode(StatusCode.IN_PROGRESS)
    failed = TransferStatus()
    failed.SetCode(StatusCode.ERR_BAD_STATE)
    e = IOEngine("mori-w", IOEngineConfig())
    try:
        assert e.wait_all([failed, running], timeout_ms=0) == StatusCode.IN_PROGRESS
        assert e.wait_all([failed, running], timeout_ms=20) == StatusCode.ERR_BAD_STATE
        assert e.wait_all([running, failed], timeout_ms=20) == StatusCode.IN_PROGRESS
        assert e.wait_all([TransferStatus()]) == StatusCode.INIT
    finally:
        e.close()


def test_sessions_and_reads(pair):
    init, _ = pair
    src, dst, lm, rm = connect(pair)
    sess = init.create_session(lm, rm)
    st = sess.batch_write([0, 65536], [4096, 0], [1024, 2048], sess.allocate_transfer_uid())
    assert st.WaitFor(-1) == StatusCode.SUCCESS and sess.alive()
    assert np.array_equal(dst[4096:5120], src[:1024]) and np.array_equal(dst[:2048],
                                                                          src[65536:67584])
    back = np.zeros(SIZE, np.uint8)
    bm = init.register_memory(back.ctypes.data, SIZE, -1, MemoryLocationType.CPU)
    st = init.read(bm, 0, rm, 0, SIZE, init.allocate_transfer_uid())
    st.Wait()
    assert st.Succeeded() and np.array_equal(back, dst)
    st = init.create_session(bm, rm).read(0, SIZE - 4, 8, 7)
    assert st.WaitFor(1000) == StatusCode.ERR_INVALID_ARGS


@pytest.mark.parametrize("notify", [False, True])
def test_enable_notification_is_honoured(pair, notify):
    init, target = pair
    src, dst, lm, rm = connect(pair, notify)
    uid = init.allocate_transfer_uid()
    assert init.write(lm, 0, rm, 0, 4096, uid).WaitFor(-1) == StatusCode.SUCCESS
    got = target.pop_inbound_transfer_status("mori-i", uid)
    if notify:
        assert got is not None and got.Succeeded()
    else:
        assert got is None


def test_backend_handling(pair, caplog):
    init, _ = pair
    init.create_backend(BackendType.TCP)
    with caplog.at_level(logging.WARNING, logger="mori.io"):
        init.create_backend(BackendType.TCP)
    assert "already created" in caplog.text
    with pytest.raises(NotImplementedError):
        init.create_backend(BackendType.Unknown)
    init.deregister_remote_engine("nobody")  # unknown: a no-op


def test_rdma_fallback_can_be_refused(monkeypatch):
    if plugin_available("rdma"):
        e = IOEngine("mori-r", IOEngineConfig())
        try:
            e.create_backend(BackendType.RDMA)
            if "rdma" in e.ferry_engine.backends():
                pytest.skip("an RDMA device is present: nothing falls back")
        finally:
            e.close()
    monkeypatch.setenv("FERRY_MORI_RDMA_FALLBACK", "0")
    e = IOEngine("mori-r2", IOEngineConfig())
    try:
        with pytest.raises(ferry.TransferError):
            e.create_backend(BackendType.RDMA)
    finally:
        e.close()


def test_register_torch_tensor(pair):
    torch = torch_or_skip()
    t = torch.zeros((4, 256), dtype=torch.float32)
    md = pair[0].register_torch_tensor(t)
    assert md.data == t.data_ptr() and md.size == t.numel() * 4 and md.device_id == -1
    with pytest.raises(RuntimeError, match="contiguous"):
        pair[0].register_torch_tensor(t.t())
