# SPDX-License-Identifier: Apache-2.0
"""examples/kv_transfer.py end to end: prefill and decode as two OS processes."""
import subprocess
import sys

import pytest

from conftest import REPO, backend_under_test

EXAMPLE = REPO / "examples" / "kv_transfer.py"


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("mode", ["write", "read"])
def test_kv_transfer_example(mode):
    r = run("--mode", mode, "--backend", backend_under_test(), "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{mode.upper()} mode: OK" in r.stdout
    assert "verified" in r.stdout


def test_kv_transfer_example_larger_layout():
    r = run("--mode", "both", "--layers", "8", "--blocks", "256", "--block-bytes", "4096",
            "--request-blocks", "200", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr


def test_kv_transfer_example_fails_cleanly():
    r = run("--mode", "write", "--backend", "nosuchbackend", "--timeout", "20")
    assert r.returncode != 0
    assert "FAILED" in r.stdout + r.stderr


@pytest.mark.skipif("not __import__('importlib').util.find_spec('torch')")
def test_kv_transfer_example_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for mode in ("write", "read"):
        r = run("--mode", mode, "--device", "cuda")
        assert r.returncode == 0, r.stdout + r.stderr
