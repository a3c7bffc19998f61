# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: engines on the tcp backend, buffers and a data pattern.

Run from the build: ctest -L python, or
  PYTHONPATH=build/python FERRY_PLUGIN_PATH=build/lib/ferry/plugins python3 -m pytest -q python/tests
"""
import os
import pathlib

import numpy as np
import pytest

import ferry

REPO = pathlib.Path(__file__).resolve().parents[2]
# Every transfer in these tests ends within this deadline (the engine's own).
TRANSFER_TIMEOUT_MS = 10000
# How long a test waits on anything before calling it a failure.
WAIT_MS = 30000


def backend_under_test():
    return os.environ.get("FERRY_TEST_BACKEND", "tcp")


def pattern(n, seed):
    """n deterministic pseudo-random bytes (differs per seed)."""
    x = np.arange(n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) % (1 << 64))
    x *= np.uint64(0xBF58476D1CE4E5B9)  # wraps modulo 2**64 (array arithmetic does not warn)
    return (x >> np.uint64(56)).astype(np.uint8)


def torch_or_skip():
    """torch, or a skip - unless FERRY_REQUIRE_TORCH=1 (scripts/run.sh test): then a failure."""
    if os.environ.get("FERRY_REQUIRE_TORCH") == "1":
        import torch
        return torch
    return pytest.importorskip("torch")


def make_engine(key, **cfg):
    cfg.setdefault("timeout_ms", TRANSFER_TIMEOUT_MS)
    return ferry.IOEngine(key, ferry.IOEngineConfig(host="127.0.0.1", port=0, **cfg))


class Pair:
    """Two engines in this process, registered both ways, each with one region."""

    def __init__(self, size, backend=None, config=None, **cfg):
        backends = backend or backend_under_test()
        backends = [backends] if isinstance(backends, str) else list(backends)
        self.initiator = make_engine("initiator", **cfg)
        self.target = make_engine("target", **cfg)
        for e in (self.initiator, self.target):
            for b in backends:
                e.create_backend(b, config)
        self.initiator.register_remote_engine(self.target.get_engine_desc())
        self.target.register_remote_engine(self.initiator.get_engine_desc())
        self.local = np.zeros(size, dtype=np.uint8)
        self.remote = np.zeros(size, dtype=np.uint8)
        self.local_mem = self.initiator.register_buffer(self.local)
        # The initiator sees the target's memory only through its packed descriptor.
        self.remote_mem = ferry.MemoryDesc.unpack(self.target.register_buffer(self.remote).pack())

    def close(self):
        self.initiator.close()
        self.target.close()


@pytest.fixture(scope="module")
def pair():
    p = Pair(4 << 20)
    yield p
    p.close()


def plugin_available(name, extra_dirs=()):
    return any(p["name"] == name and p["loaded"] for p in ferry.list_plugins(list(extra_dirs)))


@pytest.fixture(autouse=True, scope="session")
def _need_backend():
    if not plugin_available(backend_under_test()):
        pytest.fail(f"backend plugin '{backend_under_test()}' not found: set FERRY_PLUGIN_PATH "
                    "to the build's lib/ferry/plugins")
