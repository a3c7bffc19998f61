# SPDX-License-Identifier: Apache-2.0
"""The `nixl` drop-in: NIXL's agent semantics over ferry, in one process, including what
a hostile or careless caller does (test_connectors.py runs the connectors' sequences)."""
import random
import select
import threading
import time

import numpy as np
import pytest

from conftest import pattern, torch_or_skip

from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from nixl._bindings import (nixlInvalidParamError, nixlNoTelemetryError, nixlNotAllowedError,
                            nixlNotFoundError, nixlRepostActiveError, nixlXferDList)

SIZE = 1 << 20


def test_config_defaults_and_checks():
    c = nixl_agent_config()
    assert (c.backends, c.enable_pthread, c.enable_listen, c.port, c.capture_telemetry,
            c.num_threads, c.sync_mode) == (["UCX"], True, False, 8888, False, 0, None)
    with pytest.raises(TypeError):
        nixl_agent_config(sync_mode="strict")
    nixl_agent_config(sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)


class Agents:
    def __init__(self, telemetry=True):
        cfg = nixl_agent_config(capture_telemetry=telemetry)
        self.a, self.b = nixl_agent("nixl-a", cfg), nixl_agent("nixl-b", cfg)
        self.src = pattern(SIZE, 11).copy()
        self.dst = np.zeros(SIZE, np.uint8)
        self.a_descs = self.a.register_memory([(self.src.ctypes.data, SIZE, 0, "")], "DRAM",
                                              backends=["UCX"])
        arr = np.array([[self.dst.ctypes.data, SIZE, 0]], dtype=np.uint64)
        self.b_descs = self.b.register_memory(arr, "DRAM")
        self.name = self.a.add_remote_agent(self.b.get_agent_metadata())

    def lists(self, rows_a, rows_b):
        la = self.a.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.src.ctypes.data + o, n, 0)
                                                        for o, n in rows_a], "DRAM")
        lb = self.a.prep_xfer_dlist(self.name, [(self.dst.ctypes.data + o, n, 0)
                                                for o, n in rows_b], "DRAM")
        return la, lb

    def finish(self, h, timeout_s=60.0):
        # Polled as the connectors poll; bounded by time, not by a count of polls
        # (a 256 MiB transfer on a loaded machine outlasts any fixed count).
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.a.check_xfer_state(h)
            if s != "PROC":
                return s
        raise AssertionError(f"transfer did not end within {timeout_s} s")

    def close(self):
        self.a.ferry_engine.close()
        self.b.ferry_engine.close()


@pytest.fixture
def agents():
    g = Agents()
    yield g
    g.close()


def test_agent_basics(agents):
    a = agents.a
    assert "UCX" in a.get_plugin_list() and "UCX" in a.backends and a.name == "nixl-a"
    assert agents.name == b"nixl-b"
    assert a.check_remote_metadata("nixl-b") and a.check_remote_metadata(b"nixl-b")
    assert not a.check_remote_metadata("nobody")
    with pytest.raises(KeyError):
        a.register_memory([(agents.src.ctypes.data, 8, 0, "")], "DRAM", backends=["GDS"])
    with pytest.raises(nixlNotAllowedError):
        a.add_remote_agent(a.get_agent_metadata())
    assert a.add_remote_agent(agents.b.get_agent_metadata()) == b"nixl-b"  # again: fine
    empty = nixlXferDList(0)
    assert empty and empty.isEmpty() and empty.descCount() == 0  # truthy, as NIXL's
    a.remove_remote_agent("nobody")  # silent


def test_write_with_message_lands_before_the_message(agents):
    la, lb = agents.lists([(0, 4096), (8192, 4096), (65536, 1024)],
                          [(4096, 4096), (0, 4096), (SIZE - 1024, 1024)])
    h = agents.a.make_prepped_xfer("WRITE", la, np.array([0, 1, 2], np.int32), lb, [0, 1, 2],
                                   b"room_kv_0_1_0")
    assert agents.a.transfer(h) in ("DONE", "PROC")
    # The way an event loop waits: the engine's notification fd turns readable.
    readable, _, _ = select.select([agents.b.ferry_engine.notification_fd()], [], [], 30)
    assert readable
    got = agents.b.get_new_notifs()
    assert got == {"nixl-a": [b"room_kv_0_1_0"]}
    # The message came: the data is there, with no other wait.
    d, s = agents.dst, agents.src
    assert np.array_equal(d[4096:8192], s[:4096]) and np.array_equal(d[:4096], s[8192:12288])
    assert np.array_equal(d[SIZE - 1024:], s[65536:66560])
    assert agents.finish(h) == "DONE" and agents.a.check_xfer_state(h) == "DONE"
    tel = agents.a.get_xfer_telemetry(h)
    assert tel.totalBytes == 9216 and tel.descCount == 3 and tel.xferDuration > 0
    agents.a.release_xfer_handle(h)
    agents.a.release_xfer_handle(h)  # idempotent


def test_check_remote_xfer_done_matches_as_nixl_does(agents):
    # NIXL: tag_is_prefix (the default) matches a prefix; False, a substring.
    b = agents.b
    agents.a.send_notif("nixl-b", b"room7_kv_done")
    deadline = time.monotonic() + 30
    while not b.check_remote_xfer_done("nixl-a", b"kv", tag_is_prefix=False):
        assert time.monotonic() < deadline, "the message never matched as a substring"
    agents.a.send_notif("nixl-b", b"room8_kv_done")
    deadline = time.monotonic() + 30
    while not b.update_notifs().get("nixl-a"):
        assert time.monotonic() < deadline, "the second message never arrived"
    assert not b.check_remote_xfer_done("nixl-a", b"kv")  # not a prefix
    assert b.check_remote_xfer_done("nixl-a", b"room8")
    assert not b.check_remote_xfer_done("nixl-a", b"room8")  # taken once


def test_contiguous_pairs_merge_in_telemetry(agents):
    la, lb = agents.lists([(0, 4096), (4096, 4096), (8192, 4096)],
                          [(0, 4096), (4096, 4096), (65536, 4096)])
    h = agents.a.make_prepped_xfer("WRITE", la, [0, 1, 2], lb, [0, 1, 2])
    agents.a.transfer(h)
    assert agents.finish(h) == "DONE"
    assert agents.a.get_xfer_telemetry(h).descCount == 2
    assert agents.b.get_new_notifs() == {}  # no message given: none sent


def test_read_message_goes_to_the_remote(agents):
    agents.dst[:] = pattern(SIZE, 12)
    la, lb = agents.lists([(0, SIZE)], [(0, SIZE)])
    h = agents.a.make_prepped_xfer("READ", la, [0], lb, [0], notif_msg=b"req-9:1")
    agents.a.transfer(h)
    assert agents.finish(h) == "DONE"
    assert np.array_equal(agents.src, agents.dst)
    assert agents.b.ferry_engine.wait_notifications(timeout_ms=5000) == {"nixl-a": [b"req-9:1"]}
    # A repost after DONE moves the data again.
    agents.dst[:100] = 7
    assert agents.a.transfer(h) in ("DONE", "PROC") and agents.finish(h) == "DONE"
    assert (agents.src[:100] == 7).all()


def test_refusals(agents):
    a = agents.a
    with pytest.raises(nixlNotFoundError):  # beyond the peer's region
        a.prep_xfer_dlist("nixl-b", [(agents.dst.ctypes.data + SIZE - 8, 16, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):  # a length that wraps around 2**64
        a.prep_xfer_dlist("nixl-b", [(agents.dst.ctypes.data + 4096, 2**64 - 4096, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):  # not VRAM
        a.prep_xfer_dlist("nixl-b", [(agents.dst.ctypes.data, 16, 0)], "VRAM")
    with pytest.raises(nixlNotFoundError):  # the peer's memory is not ours
        a.prep_xfer_dlist("", [(agents.dst.ctypes.data, 16, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(agents.dst.ctypes.data, 16, 0)], "DRAM")
    with pytest.raises(ValueError):
        a.prep_xfer_dlist("nixl-b", np.zeros((2, 3), np.int32), "DRAM")
    la, lb = agents.lists([(0, 4096), (0, 8)], [(0, 4096), (0, 16)])
    for li, ri in (([0], [0, 1]), ([], []), ([0], [5]), ([-1], [0]), ([1], [1])):
        with pytest.raises(nixlInvalidParamError):
            a.make_prepped_xfer("WRITE", la, li, lb, ri)
    with pytest.raises(nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", lb, [0], la, [0])  # sides swapped
    with pytest.raises(KeyError):
        a.make_prepped_xfer("COPY", la, [0], lb, [0])
    with pytest.raises(nixlInvalidParamError):
        a.initialize_xfer("WRITE", a.get_xfer_descs([(agents.src.ctypes.data, 8, 0)], "DRAM"),
                          a.get_xfer_descs([(agents.dst.ctypes.data, 8, 0)] * 2, "DRAM"),
                          "nixl-b")
    with pytest.raises(nixlNotFoundError):
        a.send_notif("nobody", b"x")
    h = a.make_prepped_xfer("WRITE", la, [0], lb, [0])
    with pytest.raises(Exception) as e:
        a.check_xfer_state(h)  # never posted
    assert "NIXL_ERR_NOT_POSTED" in str(e.value)
    a.remove_remote_agent(agents.name)
    assert not a.check_remote_metadata("nixl-b")
    with pytest.raises(nixlNotFoundError):
        a.transfer(h)
    assert not agents.dst.any()


def test_no_telemetry_without_capture():
    g = Agents(telemetry=False)
    try:
        la, lb = g.lists([(0, 64)], [(0, 64)])
        h = g.a.make_prepped_xfer("WRITE", la, [0], lb, [0])
        g.a.transfer(h)
        assert g.finish(h) == "DONE"
        with pytest.raises(nixlNoTelemetryError):
            g.a.get_xfer_telemetry(h)
    finally:
        g.close()


def test_repost_while_in_progress_is_refused(agents):
    big_src = np.ones(256 << 20, np.uint8)
    big_dst = np.zeros(256 << 20, np.uint8)
    agents.a.register_memory([(big_src.ctypes.data, big_src.nbytes, 0, "")], "DRAM")
    agents.b.register_memory([(big_dst.ctypes.data, big_dst.nbytes, 0, "")], "DRAM")
    name = agents.a.add_remote_agent(agents.b.get_agent_metadata())
    la = agents.a.prep_xfer_dlist("", [(big_src.ctypes.data, big_src.nbytes, 0)], "DRAM")
    lb = agents.a.prep_xfer_dlist(name, [(big_dst.ctypes.data, big_dst.nbytes, 0)], "DRAM")
    h = agents.a.make_prepped_xfer("WRITE", la, [0], lb, [0])
    if agents.a.transfer(h) == "PROC":
        try:
            agents.a.transfer(h)
            assert agents.a.check_xfer_state(h) == "DONE"  # it had ended in between
        except nixlRepostActiveError:
            pass
    assert agents.finish(h) == "DONE" and big_dst.all()


def test_forged_metadata_is_refused(agents):
    md = agents.b.get_agent_metadata()
    rng = random.Random(5)
    for i in range(300):
        m = bytearray(md)
        if i % 3 == 0:
            m = m[:rng.randrange(len(m))]
        else:
            for _ in range(rng.randint(1, 4)):
                m[rng.randrange(len(m))] = rng.randrange(256)
        try:
            agents.a.add_remote_agent(bytes(m))
        except nixlInvalidParamError:
            pass
        except nixlNotAllowedError:
            pass  # a mutation that made it this agent's own name


def test_threads_share_an_agent(agents):
    la, lb = agents.lists([(i * 4096, 4096) for i in range(64)],
                          [(i * 4096, 4096) for i in range(64)])
    errors = []

    def worker(t):
        try:
            for k in range(8):
                i = t * 8 + k
                h = agents.a.make_prepped_xfer("WRITE", la, [i], lb, [i], f"w{i}".encode())
                agents.a.transfer(h)
                if agents.finish(h) != "DONE":
                    errors.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert np.array_equal(agents.dst[:64 * 4096], agents.src[:64 * 4096])
    got = []
    while len(got) < 64:
        batch = agents.b.ferry_engine.wait_notifications(timeout_ms=5000)
        assert batch, f"only {len(got)} messages"
        got += batch["nixl-a"]
    assert sorted(got) == sorted(f"w{i}".encode() for i in range(64))


def test_tensor_descriptors(agents):
    torch = torch_or_skip()
    t = torch.zeros(4096, dtype=torch.uint8)
    reg = agents.a.get_reg_descs(t)
    assert reg.descCount() == 1 and reg[0] == (t.data_ptr(), 4096, 0, "")
    agents.a.register_memory(reg)
    x = agents.a.get_xfer_descs([t, t])
    assert x.descCount() == 2
    agents.a.deregister_memory(reg)
    with pytest.raises(nixlNotFoundError):
        agents.a.prep_xfer_dlist("", x)


def test_engine_address_for_other_nodes(monkeypatch):
    # SGLang's nixl backend names no host: the engine must not advertise
    # loopback where the node has a route (a decode on another node would dial
    # its own loopback). The application's variable wins, in this order.
    from nixl import _api
    for var in ("FERRY_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST", "SGLANG_HOST_IP", "HOST_IP"):
        monkeypatch.delenv(var, raising=False)
    routed = _api._route_source_address()
    assert _api._engine_host() == (routed or "127.0.0.1")
    assert routed is None or not routed.startswith("127.")
    monkeypatch.setenv("HOST_IP", "127.0.0.3")
    monkeypatch.setenv("SGLANG_HOST_IP", "[127.0.0.2]")
    assert _api._engine_host() == "127.0.0.2"
    a = nixl_agent("nixl-host-check", nixl_agent_config())
    try:
        assert a.ferry_engine.get_engine_desc().host == "127.0.0.2"
    finally:
        a.ferry_engine.close()
