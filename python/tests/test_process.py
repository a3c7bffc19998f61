# SPDX-License-Identifier: Apache-2.0
"""A target engine in a second OS process: engine/session x single/batch x read/write,
data checked on both sides and the target notified."""
import hashlib
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest

import ferry
from conftest import WAIT_MS, backend_under_test, make_engine, pattern

HERE = pathlib.Path(__file__).resolve().parent
REGION = 8 << 20


class Peer:
    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "peer.py"), "target", backend_under_test(), str(REGION),
             "10000"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        words = self.readline(60).split()
        assert words and words[0] == "READY", words
        self.engine_desc = ferry.EngineDesc.unpack(bytes.fromhex(words[1]))
        self.mem = ferry.MemoryDesc.unpack(bytes.fromhex(words[2]))

    def readline(self, timeout_s):
        # A bounded read: a dead or wedged peer fails the test instead of hanging it.
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        if not out:
            self.proc.kill()
            raise TimeoutError("peer did not answer")
        return out[0].strip()

    def ask(self, line, timeout_s=60):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.readline(timeout_s)

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            assert self.proc.wait(30) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    eng = make_engine("initiator")
    eng.create_backend(backend_under_test())
    eng.register_remote_engine(p.engine_desc)
    assert p.ask("register " + eng.get_engine_desc().pack().hex()) == "OK"
    local = np.zeros(REGION, dtype=np.uint8)
    p.eng, p.local, p.local_mem = eng, local, eng.register_buffer(local)
    yield p
    eng.close()
    p.close()


def sha(a):
    return hashlib.sha256(a.tobytes()).hexdigest()


@pytest.mark.parametrize("session", [False, True], ids=["engine", "session"])
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_cross_process(peer, session, batch, op):
    p, e = peer, peer.eng
    n = (3 << 20) + 5
    if batch:
        lo, ro, sz = [0, n // 2 + 100], [4096, n // 2 + 9000], [n // 2, n - n // 2]
    else:
        lo, ro, sz = [64], [128], [n]
    seed = 11 + session * 2 + batch * 4 + (op == "read") * 8
    if op == "write":
        p.local[:] = pattern(REGION, seed)
        assert p.ask("zero") == "OK"
    else:
        assert p.ask(f"fill {seed}") == "OK"
        p.local[:] = 0
    if session:
        s = e.create_session(p.local_mem, p.mem)
        assert s is not None and s.alive()
        uid = s.allocate_transfer_uid()
        if batch:
            st = (s.batch_write if op == "write" else s.batch_read)(lo, ro, sz, uid)
        else:
            st = (s.write if op == "write" else s.read)(lo[0], ro[0], sz[0], uid)
    else:
        uid = e.allocate_transfer_uid()
        if batch:
            st = (e.batch_write if op == "write" else e.batch_read)(p.local_mem, lo, p.mem, ro, sz, uid)
        else:
            st = (e.write if op == "write" else e.read)(p.local_mem, lo[0], p.mem, ro[0], sz[0], uid)
    assert st.WaitFor(WAIT_MS), "transfer did not end"
    assert st.Succeeded(), st.Message()
    remote_src = pattern(REGION, seed)
    for l, r, k in zip(lo, ro, sz):
        if op == "write":
            assert p.ask(f"sha {r} {k}") == "SHA " + sha(p.local[l:l + k])
        else:
            assert np.array_equal(p.local[l:l + k], remote_src[r:r + k])
    assert p.ask(f"pop initiator {uid} {WAIT_MS}") == "LANDED SUCCESS"
