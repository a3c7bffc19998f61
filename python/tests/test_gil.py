# SPDX-License-Identifier: Apache-2.0
"""Waiting releases the GIL: another Python thread makes progress meanwhile.

The slow transfer is a scripted one: the test-only 'fault' plugin in 'hang' mode
accepts a transfer and never completes it, so the engine's deadline (timeout_ms)
ends it with ERR_TIMEOUT (the plugin is built with the tests, in <build>/test-plugins).
"""
import os
import threading
import time

import pytest

import ferry
from conftest import WAIT_MS, make_engine, plugin_available

TEST_PLUGINS = os.environ.get("FERRY_TEST_PLUGIN_DIR", "")


class Counter(threading.Thread):
    """Counts as fast as it can, noting the time every 256 counts."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop = False
        self.stamps = []
        self.started_evt = threading.Event()

    def run(self):
        n = 0
        self.started_evt.set()
        while not self.stop:
            n += 1
            if n % 256 == 0:
                self.stamps.append(time.monotonic())


MARGIN = 0.02  # seconds at each end of a wait that do not count


def progress_during(fn):
    """Runs fn() here; returns (its result, how often another thread ran in the middle of it).

    A wait that held the GIL would leave no stamp strictly inside its window: the
    other thread could run only before the call or after it returned.
    """
    c = Counter()
    c.start()
    assert c.started_evt.wait(10)
    t0 = time.monotonic()
    result = fn()
    t1 = time.monotonic()
    c.stop = True
    c.join(10)
    inside = sum(1 for t in c.stamps if t0 + MARGIN < t < t1 - MARGIN)
    return result, inside


def hang_pair(timeout_ms):
    cfg = dict(timeout_ms=timeout_ms, plugin_dirs=[TEST_PLUGINS])
    a, b = make_engine("gil-a", **cfg), make_engine("gil-b", **cfg)
    a.create_backend("fault", {"mode": "hang"})
    b.create_backend("fault", {"mode": "ok"})
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    return a, b


@pytest.mark.skipif(not TEST_PLUGINS or not plugin_available("fault", [TEST_PLUGINS]),
                    reason="test plugin 'fault' not built (FERRY_TEST_PLUGIN_DIR)")
def test_wait_releases_gil_on_a_hung_transfer():
    a, b = hang_pair(timeout_ms=800)
    try:
        la, lb = bytearray(4096), bytearray(4096)
        ma, mb = a.register_buffer(la), b.register_buffer(lb)
        st = a.write(ma, 0, mb, 0, 4096, a.allocate_transfer_uid())
        # A second one hangs as well (posted before the first ends: after that the
        # peer is fenced and new transfers fail at once).
        st2 = a.write(ma, 0, mb, 0, 16, a.allocate_transfer_uid())
        assert st.InProgress()
        # WaitFor with a short limit returns False, having let the other thread run.
        done, n = progress_during(lambda: st.WaitFor(300))
        assert done is False and n > 0, n
        # wait_all likewise.
        ok, n = progress_during(lambda: ferry.wait_all([st2], timeout_ms=200))
        assert ok is False and n > 0, n
        # Wait() returns when the deadline ends the transfer; the thread ran meanwhile.
        # A backend that never reported back may still be copying: outcome unknown.
        t0 = time.monotonic()
        code, n = progress_during(st.Wait)
        assert code == ferry.StatusCode.ERR_OUTCOME_UNKNOWN, st.Message()
        assert time.monotonic() - t0 < WAIT_MS / 1000
        assert n > 0, n
        # wait_inbound with a limit returns None and releases the GIL too.
        got, n = progress_during(lambda: b.wait_inbound("gil-a", 12345, timeout_ms=300))
        assert got is None and n > 0, n
    finally:
        a.close()  # completes the hung transfers
        b.close()


@pytest.mark.skipif(not TEST_PLUGINS or not plugin_available("fault", [TEST_PLUGINS]),
                    reason="test plugin 'fault' not built (FERRY_TEST_PLUGIN_DIR)")
def test_ctrl_c_interrupts_a_wait():
    import _thread

    a, b = hang_pair(timeout_ms=20000)
    try:
        la, lb = bytearray(64), bytearray(64)
        ma, mb = a.register_buffer(la), b.register_buffer(lb)
        st = a.write(ma, 0, mb, 0, 64, a.allocate_transfer_uid())
        timer = threading.Timer(0.2, _thread.interrupt_main)
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            st.Wait()
        assert time.monotonic() - t0 < 5
        assert st.InProgress()  # the wait was interrupted, not the transfer
    finally:
        a.close()  # ends the hung transfer
        b.close()
    assert st.Failed()


def test_the_probe_tells_a_held_gil_from_a_released_one():
    """Control: a call that blocks holding the GIL leaves no progress inside its window."""
    import ctypes

    _, held = progress_during(lambda: ctypes.PyDLL(None).usleep(300000))
    _, released = progress_during(lambda: ctypes.CDLL(None).usleep(300000))
    assert held == 0
    assert released > 0
