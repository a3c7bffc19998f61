# SPDX-License-Identifier: Apache-2.0
"""The connectors' call sequences, each in two processes, through the drop-in packages:
vLLM's MoRIIOConnector and SGLang's mori backend on `mori.io`, vLLM's NixlConnector and
SGLang's nixl backend on `nixl._api` (python/tests/connectors/*.py say what each does).
CPU tensors here; tests/gpu/run-all.sh runs them with CUDA tensors
(FERRY_CONNECTOR_DEVICE=cuda does the same here)."""
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import torch_or_skip

HERE = pathlib.Path(__file__).resolve().parent / "connectors"
DEVICE = os.environ.get("FERRY_CONNECTOR_DEVICE", "cpu")

CASES = [
    ("vllm_moriio.py", ["--mode", "write"]),
    ("vllm_moriio.py", ["--mode", "read"]),
    ("vllm_moriio.py", ["--mode", "write", "--shared-region"]),
    ("vllm_moriio.py", ["--mode", "read", "--shared-region"]),
    ("sglang_mori.py", []),
    ("vllm_nixl.py", []),
    ("sglang_nixl.py", []),
]


@pytest.mark.parametrize("script,args", CASES, ids=[f"{s[:-3]}{''.join(a)}" for s, a in CASES])
def test_connector_sequence(script, args):
    torch_or_skip()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(HERE / script), "--device", DEVICE] + args,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{script} {args} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
