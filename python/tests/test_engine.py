# SPDX-License-Identifier: Apache-2.0
"""The transfer matrix and the error paths, two engines in one process.

Follows MORI-IO's tests/python/io/test_engine.py checklist: every combination of
engine/session x single/batch x read/write x size with data checked and the target
notified; notification off means none; out-of-range fails with ERR_INVALID_ARGS
and a later transfer still works; no backend means ERR_BAD_STATE and no session.
"""
import itertools
import socket

import numpy as np
import pytest

import ferry
from conftest import WAIT_MS, Pair, make_engine, pattern

SIZES = [1, 4096, (1 << 20) + 3]


def layout(total, batch):
    """(local_offsets, remote_offsets, sizes): one item, or up to 8 pieces with gaps."""
    if not batch:
        return [128], [256], [total]
    pieces = min(8, total)
    piece = -(-total // pieces)
    lo, ro, sz = [], [], []
    loff, roff, left = 64, 32, total
    while left > 0:
        n = min(piece, left)
        lo.append(loff)
        ro.append(roff)
        sz.append(n)
        loff += n + 16
        roff += n + 48
        left -= n
    return lo, ro, sz


def issue(p, session, batch, op, lo, ro, sz, notify=True):
    if session:
        sess = p.initiator.create_session(p.local_mem, p.remote_mem)
        assert sess is not None
        uid = sess.allocate_transfer_uid()
        if batch:
            fn = sess.batch_read if op == "read" else sess.batch_write
            return uid, fn(lo, ro, sz, uid, notify=notify)
        fn = sess.read if op == "read" else sess.write
        return uid, fn(lo[0], ro[0], sz[0], uid, notify=notify)
    uid = p.initiator.allocate_transfer_uid()
    if batch:
        fn = p.initiator.batch_read if op == "read" else p.initiator.batch_write
        return uid, fn(p.local_mem, lo, p.remote_mem, ro, sz, uid, notify=notify)
    fn = p.initiator.read if op == "read" else p.initiator.write
    return uid, fn(p.local_mem, lo[0], p.remote_mem, ro[0], sz[0], uid, notify=notify)


CASES = list(itertools.product([False, True], [False, True], ["read", "write"], SIZES))


@pytest.mark.parametrize(
    "session,batch,op,size", CASES,
    ids=[f"{'session' if s else 'engine'}-{'batch' if b else 'single'}-{o}-{n}"
         for s, b, o, n in CASES])
def test_transfer_matrix(pair, session, batch, op, size):
    p = pair
    seed = hash((session, batch, op, size)) & 0xFFFF
    lo, ro, sz = layout(size, batch)
    if op == "write":
        p.local[:] = pattern(p.local.size, seed)
        p.remote[:] = 0
    else:
        p.remote[:] = pattern(p.remote.size, seed)
        p.local[:] = 0
    uid, st = issue(p, session, batch, op, lo, ro, sz)
    assert st.WaitFor(WAIT_MS), "transfer did not end"
    assert st.Code() == ferry.StatusCode.SUCCESS, st.Message()
    assert st.Succeeded() and not st.Failed() and not st.InProgress()
    for l, r, n in zip(lo, ro, sz):
        if op == "write":
            assert np.array_equal(p.remote[r:r + n], p.local[l:l + n])
        else:
            assert np.array_equal(p.local[l:l + n], p.remote[r:r + n])
    # Only the bytes of the items moved.
    moved = np.zeros(p.remote.size, dtype=bool)
    for r, n in zip(ro, sz):
        moved[r:r + n] = True
    if op == "write":
        assert not p.remote[~moved].any()
    landed = p.target.wait_inbound("initiator", uid, timeout_ms=WAIT_MS)
    assert landed is not None, "the target was not notified"
    assert landed.Succeeded()
    # Popped once: gone.
    assert p.target.pop_inbound_transfer_status("initiator", uid) is None


def test_notify_off_means_no_inbound_status(pair):
    p = pair
    uid = p.initiator.allocate_transfer_uid()
    st = p.initiator.write(p.local_mem, 0, p.remote_mem, 0, 4096, uid, notify=False)
    assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
    # A notified transfer after it lands; the silent one still has no status.
    uid2 = p.initiator.allocate_transfer_uid()
    st2 = p.initiator.write(p.local_mem, 0, p.remote_mem, 0, 4096, uid2)
    assert st2.WaitFor(WAIT_MS) and st2.Succeeded()
    assert p.target.wait_inbound("initiator", uid2, timeout_ms=WAIT_MS) is not None
    assert p.target.pop_inbound_transfer_status("initiator", uid) is None


def test_uids_are_unique(pair):
    uids = {pair.initiator.allocate_transfer_uid() for _ in range(1000)}
    assert len(uids) == 1000


def test_numpy_offset_arrays(pair):
    p = pair
    p.local[:] = pattern(p.local.size, 77)
    lo = np.arange(0, 64 * 1024, 4096, dtype=np.int64)
    ro = lo[::-1].copy()
    sz = np.full(lo.size, 1024, dtype=np.uint64)
    uid = p.initiator.allocate_transfer_uid()
    st = p.initiator.batch_write(p.local_mem, lo, p.remote_mem, ro, sz, uid)
    assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
    for l, r in zip(lo, ro):
        assert np.array_equal(p.remote[r:r + 1024], p.local[l:l + 1024])
    assert p.target.wait_inbound("initiator", uid, timeout_ms=WAIT_MS) is not None


@pytest.mark.parametrize("session", [False, True])
def test_out_of_range_fails_then_recovers(pair, session):
    p = pair
    end = p.remote.size
    bad = ([0, 0], [0, end - 10], [16, 11])  # the second item runs past the remote end
    uid, st = issue(p, session, True, "write", *bad)
    assert st.WaitFor(WAIT_MS)
    assert st.Code() == ferry.StatusCode.ERR_INVALID_ARGS
    assert "exceeds" in st.Message()
    uid, st = issue(p, session, False, "read", [p.local.size], [0], [1])  # local offset at the end
    assert st.WaitFor(WAIT_MS) and st.Code() == ferry.StatusCode.ERR_INVALID_ARGS
    # Nothing is broken: a valid transfer right after succeeds.
    p.local[:16] = 7
    uid, st = issue(p, session, True, "write", [0], [end - 16], [16])
    assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
    assert (p.remote[end - 16:] == 7).all()


def test_bad_transfer_arguments(pair):
    p = pair
    e = p.initiator
    uid = e.allocate_transfer_uid()
    with pytest.raises(ValueError):
        e.write(p.local_mem, -1, p.remote_mem, 0, 1, uid)
    with pytest.raises(ValueError):
        e.batch_write(p.local_mem, [0, -5], p.remote_mem, [0, 0], [1, 1], uid)
    with pytest.raises(ValueError):
        e.batch_read(p.local_mem, np.array([-1]), p.remote_mem, [0], [1], uid)
    with pytest.raises(TypeError):
        e.write(p.local_mem, "0", p.remote_mem, 0, 1, uid)
    with pytest.raises(TypeError):
        e.write(p.local_mem, 0, "not a desc", 0, 1, uid)
    # Mismatched lengths and zero sizes are transfer outcomes, as in MORI-IO.
    st = e.batch_write(p.local_mem, [0, 1], p.remote_mem, [0], [1, 1], uid)
    assert st.Code() == ferry.StatusCode.ERR_INVALID_ARGS
    st = e.write(p.local_mem, 0, p.remote_mem, 0, 0, uid)
    assert st.Code() == ferry.StatusCode.ERR_INVALID_ARGS
    st = e.batch_write(p.local_mem, [], p.remote_mem, [], [], uid)
    assert st.Code() == ferry.StatusCode.ERR_INVALID_ARGS


def test_unknown_memory_and_engine():
    p = Pair(1 << 16)
    try:
        foreign = p.target.register_buffer(bytearray(64))  # target's memory used as "local"
        st = p.initiator.write(foreign, 0, p.remote_mem, 0, 1, 1)
        assert st.Code() == ferry.StatusCode.ERR_NOT_FOUND
        p.initiator.deregister_remote_engine("target")
        st = p.initiator.write(p.local_mem, 0, p.remote_mem, 0, 1, 2)
        assert st.Code() == ferry.StatusCode.ERR_NOT_FOUND
        assert "not registered" in st.Message()
        with pytest.raises(LookupError):
            p.initiator.deregister_remote_engine("target")
        # Registering again brings it back.
        p.initiator.register_remote_engine(p.target.get_engine_desc())
        st = p.initiator.write(p.local_mem, 0, p.remote_mem, 0, 1, 3)
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
    finally:
        p.close()


def test_no_backend_means_bad_state_and_no_session():
    a, b = make_engine("nb-a"), make_engine("nb-b")
    try:
        a.register_remote_engine(b.get_engine_desc())
        b.register_remote_engine(a.get_engine_desc())
        la, lb = bytearray(4096), bytearray(4096)
        ma, mb = a.register_buffer(la), b.register_buffer(lb)
        assert a.backends() == []
        st = a.write(ma, 0, mb, 0, 16, a.allocate_transfer_uid())
        assert st.Code() == ferry.StatusCode.ERR_BAD_STATE
        assert st.Failed()
        assert a.create_session(ma, mb) is None
        with pytest.raises(ferry.TransferError) as ei:
            a.create_session(ma, mb, raise_on_failure=True)
        assert ei.value.code == ferry.StatusCode.ERR_BAD_STATE
    finally:
        a.close()
        b.close()


def test_port_zero_picks_a_free_port():
    a, b = make_engine("p0-a"), make_engine("p0-b")
    try:
        pa, pb = a.get_engine_desc().port, b.get_engine_desc().port
        assert pa != 0 and pb != 0 and pa != pb
    finally:
        a.close()
        b.close()


def test_explicit_port_and_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(Exception) as ei:
            ferry.IOEngine("busy", ferry.IOEngineConfig(port=busy))
        assert isinstance(ei.value, (ferry.TransferError, ValueError))
    # The port is free again (nothing else should grab it in this instant).
    e = ferry.IOEngine("fixed", ferry.IOEngineConfig(port=busy))
    try:
        assert e.get_engine_desc().port == busy
    finally:
        e.close()


def test_node_id_override():
    e = make_engine("nid", node_id="node-17")
    try:
        assert e.get_engine_desc().node_id == "node-17"
    finally:
        e.close()


def test_config_validation():
    with pytest.raises(ValueError):
        ferry.IOEngineConfig(port=70000)
    with pytest.raises(ValueError):
        ferry.IOEngineConfig(port=-1)
    cfg = ferry.IOEngineConfig()
    assert cfg.host == "127.0.0.1" and cfg.port == 0
    cfg.port = 8080
    assert cfg.port == 8080
    with pytest.raises(ValueError):
        cfg.port = 65536
    with pytest.raises(ValueError):
        ferry.IOEngine("", cfg)


def test_inbound_limits_in_the_config():
    cfg = ferry.IOEngineConfig()
    assert cfg.inbound_max_per_peer == 65536
    assert cfg.inbound_max_age_ms == 600000
    cfg.inbound_max_per_peer = 8
    cfg.inbound_max_age_ms = 0
    assert (cfg.inbound_max_per_peer, cfg.inbound_max_age_ms) == (8, 0)
    with pytest.raises((ValueError, OverflowError, TypeError)):
        cfg.inbound_max_per_peer = -1


def test_unpopped_inbound_statuses_stop_at_the_configured_cap():
    # A target that never pops keeps only the newest inbound_max_per_peer.
    cfg = ferry.IOEngineConfig(host="127.0.0.1", timeout_ms=10000)
    cfg.inbound_max_per_peer = 2
    target = ferry.IOEngine("capped-target", cfg)
    initiator = make_engine("capped-initiator")
    try:
        for e in (initiator, target):
            e.create_backend("tcp")
        initiator.register_remote_engine(target.get_engine_desc())
        target.register_remote_engine(initiator.get_engine_desc())
        src = np.ones(4096, dtype=np.uint8)
        dst = np.zeros(4096, dtype=np.uint8)
        local = initiator.register_buffer(src)
        remote = ferry.MemoryDesc.unpack(target.register_buffer(dst).pack())
        uids = []
        for _ in range(5):
            uid = initiator.allocate_transfer_uid()
            st = initiator.write(local, 0, remote, 0, 4096, uid, notify=True)
            # tcp records the landing at the target before the initiator completes
            assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
            uids.append(uid)
        s = target.stats()
        assert s["inbound_notifications"] == 5
        assert s["inbound_dropped"] == 3
        assert target.pop_inbound_transfer_status("capped-initiator", uids[0]) is None
        assert target.pop_inbound_transfer_status("capped-initiator", uids[4]) is not None
        assert target.pop_inbound_transfer_status("capped-initiator", uids[3]) is not None
    finally:
        initiator.close()
        target.close()


def test_backend_names_and_errors():
    e = make_engine("be")
    try:
        e.create_backend(ferry.BackendType.TCP)
        assert e.backends() == ["tcp"]
        e.remove_backend("TCP")
        assert e.backends() == []
        e.create_backend("BackendType.TCP", {"lanes": 2})
        e.remove_backend(ferry.BackendType.TCP)
        e.create_backend("tcp", ferry.TcpBackendConfig(lanes=3))
        with pytest.raises(ferry.TransferError):
            e.create_backend("tcp")  # already loaded
        with pytest.raises(LookupError):
            e.remove_backend("ofi")  # not loaded
        with pytest.raises(ferry.TransferError) as ei:
            e.create_backend("nosuchplugin")
        assert "nosuchplugin" in str(ei.value)
        with pytest.raises(ValueError):
            e.create_backend("bad name!")
        with pytest.raises(ValueError):
            e.create_backend(ferry.BackendType.Unknown)
        with pytest.raises(TypeError):
            e.create_backend(3.5)
    finally:
        e.close()
    f = make_engine("be2")
    try:
        with pytest.raises(ValueError):
            f.create_backend("tcp", {"lanes": "many"})
        with pytest.raises(ValueError):
            f.create_backend("tcp", "{not json")
    finally:
        f.close()


def test_register_buffer_rules():
    e = make_engine("reg")
    try:
        with pytest.raises(ValueError):
            e.register_buffer(b"read-only bytes")
        with pytest.raises(ValueError):
            e.register_buffer(np.zeros((8, 8), dtype=np.uint8)[:, ::2])  # not C-contiguous
        ro = np.zeros(16, dtype=np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError):
            e.register_buffer(ro)
        with pytest.raises(ValueError):
            e.register_buffer(bytearray())
        with pytest.raises(TypeError):
            e.register_buffer(12345)
        # The engine holds the buffer: a registered bytearray cannot be resized.
        ba = bytearray(1024)
        m = e.register_buffer(ba)
        assert m.size == 1024 and m.location == ferry.MemoryLocationType.CPU
        with pytest.raises(BufferError):
            ba.extend(b"x" * 4096)
        e.deregister_memory(m)
        ba.extend(b"x")  # released
        with pytest.raises(LookupError):
            e.deregister_memory(m)
        # An anonymous mmap: registered, and it cannot be closed while registered.
        import mmap

        mm = mmap.mmap(-1, 8192)
        m3 = e.register_buffer(mm)
        assert m3.size == 8192
        with pytest.raises(BufferError):
            mm.close()
        e.deregister_memory(m3)
        mm.close()
        with pytest.raises(ValueError):
            e.register_buffer(memoryview(b"abc"))  # read-only view
        m4 = e.register_buffer(memoryview(bytearray(32))[8:24])
        assert m4.size == 16
        e.deregister_memory(m4)
        # Raw pointers.
        arr = np.zeros(256, dtype=np.uint8)
        m2 = e.register_memory(arr.ctypes.data, arr.nbytes, -1, ferry.MemoryLocationType.CPU)
        assert m2.addr == arr.ctypes.data and m2.size == 256
        e.deregister_memory(m2)
        with pytest.raises(ValueError):
            e.register_memory(0, 16)
        with pytest.raises(ValueError):
            e.register_memory(arr.ctypes.data, 0)
    finally:
        e.close()


def test_registered_buffer_outlives_python_reference():
    """register_buffer keeps the object alive: dropping the caller's name is safe."""
    p = Pair(1 << 12)
    try:
        tmp = bytearray(pattern(4096, 5).tobytes())
        m = p.initiator.register_buffer(tmp)
        del tmp
        uid = p.initiator.allocate_transfer_uid()
        st = p.initiator.write(m, 0, p.remote_mem, 0, 4096, uid)
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
        assert np.array_equal(p.remote, pattern(4096, 5))
    finally:
        p.close()


def test_closed_engine():
    p = Pair(4096)
    sess = p.initiator.create_session(p.local_mem, p.remote_mem)
    assert sess is not None and sess.alive()
    with p.initiator as e:
        assert not e.closed
    assert p.initiator.closed
    assert not sess.alive()
    with pytest.raises(ferry.TransferError):
        sess.write(0, 0, 1, 1)
    with pytest.raises(ferry.TransferError) as ei:
        p.initiator.allocate_transfer_uid()
    assert ei.value.code == ferry.StatusCode.ERR_BAD_STATE
    p.initiator.close()  # idempotent
    p.target.close()


def test_session_keeps_engine_alive():
    p = Pair(4096)
    sess = p.initiator.create_session(p.local_mem, p.remote_mem)
    p.local[:] = 9
    p.initiator = None  # the session still holds the engine
    st = sess.write(0, 0, 4096, sess.allocate_transfer_uid())
    assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
    assert (p.remote == 9).all()
    del sess
    p.target.close()


def test_stats_and_policy(pair):
    s = pair.initiator.stats()
    assert set(s) == {"backends", "inbound_notifications", "inbound_dropped", "ctrl_rejected",
                      "ctrl_unix_connections", "notifies_resent", "notifies_unanswered",
                      "fences", "fence_unknown", "fenced_peers", "notifications_received",
                      "notifications_refused", "notifications_unread"}
    tcp = s["backends"]["tcp"]
    assert tcp["transfers"] >= 1 and tcp["bytes"] >= 1
    assert pair.target.stats()["inbound_notifications"] >= 1
    assert pair.initiator.policy_source()


def test_stats_socket_serves_the_same_stats(tmp_path):
    """stats_socket: another process (here, a plain socket client) reads the stats as JSON."""
    import json

    path = str(tmp_path / "{key}.sock")
    e = make_engine("stats-engine", stats_socket=path)
    assert e is not None
    sock_path = str(tmp_path / "stats-engine.sock")
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(5)
    c.connect(sock_path)
    doc = b""
    while chunk := c.recv(4096):
        doc += chunk
    c.close()
    j = json.loads(doc)
    assert j["engine"] == "stats-engine"
    assert j["backends"] == e.stats()["backends"]
    e.close()
    assert not (tmp_path / "stats-engine.sock").exists()


def test_wait_all(pair):
    p = pair
    sts = [p.initiator.write(p.local_mem, i * 1024, p.remote_mem, i * 1024, 1024,
                             p.initiator.allocate_transfer_uid()) for i in range(16)]
    assert ferry.wait_all(sts, timeout_ms=WAIT_MS)
    assert ferry.IOEngine.wait_all(sts)
    assert all(s.Succeeded() for s in sts)
    assert ferry.wait_all([]) is True


def test_transfer_status_object():
    st = ferry.TransferStatus()
    assert st.Code() == ferry.StatusCode.INIT and st.InProgress() and st.Init()
    assert st.WaitFor(10) is False
    assert st.Message() == ""
    assert "INIT" in repr(st)
    assert ferry.StatusCode.ERR_INVALID_ARGS == 11 and ferry.StatusCode.SUCCESS == 0


def _has_auth():
    try:
        return ferry.IOEngineConfig(auth_token="x").auth_token == "x"
    except ValueError:
        return False


@pytest.mark.skipif(not _has_auth(), reason="this ferry core has no auth_token")
def test_auth_token():
    ok = Pair(4096, auth_token="s3cret")
    try:
        ok.local[:] = 3
        st = ok.initiator.write(ok.local_mem, 0, ok.remote_mem, 0, 4096, 1)
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
        assert (ok.remote == 3).all()
        assert "s3cret" not in repr(ferry.IOEngineConfig(auth_token="s3cret"))
    finally:
        ok.close()
    a = make_engine("auth-a", auth_token="one")
    b = make_engine("auth-b", auth_token="two")
    try:
        for e in (a, b):
            e.create_backend("tcp")
        a.register_remote_engine(b.get_engine_desc())
        b.register_remote_engine(a.get_engine_desc())
        src, dst = bytearray(b"x" * 64), bytearray(64)
        ma, mb = a.register_buffer(src), b.register_buffer(dst)
        st = a.write(ma, 0, mb, 0, 64, 1)
        assert st.WaitFor(WAIT_MS) and st.Failed()
        assert dst == bytearray(64)
    finally:
        a.close()
        b.close()


def test_connector_habits_one_way_registration_and_notify_off():
    # What vLLM's MoRIIOConnector does: only the initiator registers (the
    # target's descriptor), the target never pops, so notification is turned
    # off once for the engine; a repeated registration keeps sessions alive.
    cfg = ferry.IOEngineConfig(host="127.0.0.1", port=0)
    cfg.timeout_ms = 10000
    cfg.notify = False
    assert cfg.notify is False
    initiator = ferry.IOEngine("quiet-initiator", cfg)
    target = make_engine("quiet-target")
    try:
        for e in (initiator, target):
            e.create_backend("tcp")
        local = pattern(1 << 16, 5)
        remote = np.zeros(1 << 16, dtype=np.uint8)
        lmem = initiator.register_buffer(local)
        rmem = ferry.MemoryDesc.unpack(target.register_buffer(remote).pack())
        initiator.register_remote_engine(target.get_engine_desc())
        session = initiator.create_session(lmem, rmem)
        uid = initiator.allocate_transfer_uid()
        st = session.write(0, 0, local.nbytes, uid)
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
        assert np.array_equal(remote, local)
        assert target.pop_inbound_transfer_status("quiet-initiator", uid) is None
        initiator.register_remote_engine(target.get_engine_desc())  # a repeated handshake
        uid2 = initiator.allocate_transfer_uid()
        st2 = session.write(0, 0, 4096, uid2, notify=True)
        assert st2.WaitFor(WAIT_MS) and st2.Succeeded(), st2.Message()
        assert target.wait_inbound("quiet-initiator", uid2, timeout_ms=WAIT_MS) is not None
    finally:
        initiator.close()
        target.close()


def test_a_poll_hands_a_queued_tcp_transfer_to_its_lanes():
    """WaitFor(0) is a poll that drives the backend once (as C++): tcp's post() only queues a
    transfer, and the poll of an application that checks its transfers from its own loop (the
    NIXL and MORI shims' status reads) hands it over, not the plugin's flusher."""
    from conftest import backend_under_test

    if backend_under_test() != "tcp":
        pytest.skip("the post queue is tcp's")
    # Flusher ticks of 50 ms: a poll right after the post gets there first unless this thread
    # stalls that long, so ten transfers leave at least one to the polls.
    p = Pair(1 << 16, config='{"post_flush_us": 100000}')
    try:
        for i in range(10):
            p.local[:4096] = i + 1
            st = p.initiator.write(p.local_mem, 0, p.remote_mem, 0, 4096,
                                   p.initiator.allocate_transfer_uid())
            for _ in range(1_000_000):
                if st.WaitFor(0):
                    break
            assert st.Succeeded(), st.Message()
            assert (p.remote[:4096] == i + 1).all()
        tcp = p.initiator.stats()["backends"]["tcp"]["plugin"]
        assert tcp["posts_by_waiters"] + tcp["posts_by_flusher"] == 10
        assert tcp["posts_by_waiters"] >= 1
    finally:
        p.close()
