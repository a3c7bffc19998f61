# SPDX-License-Identifier: Apache-2.0
"""Running in a cluster (issue 21) from Python: the engine publishes and fetches
descriptors through a real etcd (Debian's etcd-server, started here on a free
port and stopped after), and serves Prometheus /metrics. etcd missing skips,
unless FERRY_REQUIRE_ETCD=1 (scripts/run.sh test): then it fails."""
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import numpy as np
import pytest

import ferry
from conftest import WAIT_MS, make_engine, pattern


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd():
    binary = shutil.which("etcd")
    if not binary:
        if os.environ.get("FERRY_REQUIRE_ETCD") == "1":
            pytest.fail("etcd is not installed (apt-get install etcd-server)")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    data = tempfile.mkdtemp(prefix="ferry-etcd-py-")
    ep, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [binary, "--name=py", f"--data-dir={data}/d", f"--listen-client-urls={ep}",
         f"--advertise-client-urls={ep}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=py={peer}",
         "--log-level=warn", "--logger=zap"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:  # ready when it answers a range request (polled, bounded)
        try:
            urllib.request.urlopen(urllib.request.Request(ep + "/v3/kv/range", data=b'{"key":"eA=="}'),
                                   timeout=1).read()
            break
        except OSError:
            assert proc.poll() is None, "etcd exited at start"
            assert time.monotonic() < deadline, "etcd never served"
            time.sleep(0.05)
    yield ep
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(data, ignore_errors=True)


def test_publish_fetch_and_transfer(etcd):
    kw = dict(etcd_endpoints=[etcd], etcd_namespace="py", etcd_lease_ms=3000)
    target = make_engine("py-target", **kw)
    initiator = make_engine("py-initiator", metrics_address="127.0.0.1:0", **kw)
    assert initiator.metrics_address().startswith("127.0.0.1:")
    assert target.metrics_address() == ""
    for e in (target, initiator):
        e.create_backend("tcp", None)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    src = pattern(1 << 16, 11)
    target.publish_memory("kv", target.register_buffer(dst))
    initiator.fetch_remote_engine("py-target", wait_ms=WAIT_MS)
    remote = initiator.fetch_memory("py-target", "kv", wait_ms=WAIT_MS)
    local = initiator.register_buffer(src)
    st = initiator.write(local, 0, remote, 0, src.size, initiator.allocate_transfer_uid())
    assert st.Wait() == ferry.StatusCode.SUCCESS, st.Message()
    assert np.array_equal(dst, src)
    body = urllib.request.urlopen(f"http://{initiator.metrics_address()}/metrics", timeout=5).read()
    assert b'ferry_transfers_total{backend="tcp",op="write"} 1' in body
    with pytest.raises(ferry.NotFoundError):
        initiator.fetch_memory("py-target", "absent")
    target.close()
    initiator.close()


def test_config_kwargs_and_no_store():
    c = ferry.IOEngineConfig(etcd_endpoints=["http://127.0.0.1:1"], etcd_namespace="n",
                             etcd_lease_ms=5000, metrics_address="127.0.0.1:0")
    assert c.etcd_endpoints == ["http://127.0.0.1:1"]
    assert (c.etcd_namespace, c.etcd_lease_ms, c.metrics_address) == ("n", 5000, "127.0.0.1:0")
    e = make_engine("py-nostore")
    with pytest.raises(ferry.TransferError):  # ERR_BAD_STATE: no store configured
        e.fetch_remote_engine("x")
    e.close()
