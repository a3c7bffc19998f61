# SPDX-License-Identifier: Apache-2.0
"""Notification messages across two OS processes: standalone and attached to
transfers (numpy and torch CPU tensors), in order and exactly once, listed by
sender; the inbox's fd drives an asyncio loop; waits release the GIL."""
import asyncio

import numpy as np
import pytest

import ferry
from conftest import WAIT_MS, make_engine, pattern, torch_or_skip
from test_gil import progress_during
from test_process import REGION, Peer, sha


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    eng = make_engine("initiator")
    eng.create_backend("tcp")
    eng.register_remote_engine(p.engine_desc)  # one way: the target learns us from our hello
    local = np.zeros(REGION, dtype=np.uint8)
    p.eng, p.local, p.local_mem = eng, local, eng.register_buffer(local)
    yield p
    eng.close()
    p.close()


def received(p, ms=5000):
    words = p.ask(f"notifs {ms}").split()
    assert words[0] == "NOTIFS", words
    out = []
    for kv in words[1:]:
        k, h = kv.split(":")
        out.append((k, bytes.fromhex(h)))
    return out


def test_standalone_messages_arrive_in_order_once(peer):
    sts = [peer.eng.send_notification(peer.engine_desc.key, f"req-{i}:8".encode()) for i in range(300)]
    assert ferry.wait_all(sts, timeout_ms=WAIT_MS)
    assert all(s.Succeeded() for s in sts), [s.Message() for s in sts if not s.Succeeded()]
    got = []
    while len(got) < 300:
        more = received(peer)
        assert more, len(got)
        got += more
    assert got == [("initiator", f"req-{i}:8".encode()) for i in range(300)]
    assert received(peer, 100) == []
    # str is UTF-8; bytearray/memoryview are bytes; None and >64 KiB are refused.
    assert peer.eng.send_notification(peer.engine_desc.key, "é").Wait() == ferry.StatusCode.SUCCESS
    assert peer.eng.send_notification(peer.engine_desc.key, memoryview(b"mv")).Wait() == \
        ferry.StatusCode.SUCCESS
    assert received(peer) == [("initiator", "é".encode()), ("initiator", b"mv")]
    big = peer.eng.send_notification(peer.engine_desc.key, bytes(64 * 1024 + 1))
    assert big.Code() == ferry.StatusCode.ERR_INVALID_ARGS, big.Message()
    with pytest.raises(ferry.InvalidArgumentError):
        peer.eng.send_notification(peer.engine_desc.key, None)


@pytest.mark.parametrize("session", [False, True], ids=["engine", "session"])
def test_attached_message_follows_the_data(peer, session):
    data = pattern(1 << 20, 31 + session)
    peer.local[: data.size] = data
    if session:
        s = peer.eng.create_session(peer.local_mem, peer.mem, raise_on_failure=True)
        st = s.write(0, 0, data.size, s.allocate_transfer_uid(), message=b"kv ready")
    else:
        st = peer.eng.batch_write(peer.local_mem, [0, 4096], peer.mem, [0, 4096],
                                  [4096, data.size - 4096], 7, notify=False, message=b"kv ready")
    assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
    assert received(peer) == [("initiator", b"kv ready")]
    assert peer.ask(f"sha 0 {data.size}") == "SHA " + sha(data)


def test_torch_cpu_tensors_with_a_message(peer):
    torch = torch_or_skip()
    t = torch.arange(1 << 16, dtype=torch.int32)
    mem = peer.eng.register_torch_tensor(t)
    try:
        nbytes = t.numel() * t.element_size()
        st = peer.eng.write(mem, 0, peer.mem, 0, nbytes, 9, message="layer 0..31 done")
        assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
        assert received(peer) == [("initiator", b"layer 0..31 done")]
        assert peer.ask(f"sha 0 {nbytes}") == "SHA " + sha(t.numpy())
        back = torch.zeros_like(t)
        bmem = peer.eng.register_torch_tensor(back)
        st = peer.eng.read(bmem, 0, peer.mem, 0, nbytes, 10, message=b"read back")
        assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
        assert torch.equal(back, t)
        assert received(peer) == [("initiator", b"read back")]
        peer.eng.deregister_memory(bmem)
    finally:
        peer.eng.deregister_memory(mem)


def test_asyncio_loop_wakes_on_the_notification_fd(peer):
    fd = peer.eng.notification_fd()
    assert peer.eng.get_new_notifications() == {}

    async def main():
        loop = asyncio.get_running_loop()
        got = {}
        done = asyncio.Event()

        def on_readable():
            for k, msgs in peer.eng.get_new_notifications().items():
                got.setdefault(k, []).extend(msgs)
            if sum(len(v) for v in got.values()) >= 3:
                done.set()

        loop.add_reader(fd, on_readable)
        try:
            # The target sends from its own process while this loop waits.
            sender = loop.run_in_executor(
                None, lambda: [peer.ask(f"send initiator {m.hex()}") for m in (b"a", b"b", b"c")])
            await asyncio.wait_for(done.wait(), WAIT_MS / 1000)
            assert await sender == ["SENT SUCCESS"] * 3
        finally:
            loop.remove_reader(fd)
        return got

    got = asyncio.run(main())
    assert got == {peer.engine_desc.key: [b"a", b"b", b"c"]}


def test_wait_notifications_releases_the_gil(peer):
    got, n = progress_during(lambda: peer.eng.wait_notifications(timeout_ms=300))
    assert got == {} and n > 0, n
    assert peer.ask("send initiator 6869") == "SENT SUCCESS"
    assert peer.eng.wait_notifications(timeout_ms=WAIT_MS) == {peer.engine_desc.key: [b"hi"]}
