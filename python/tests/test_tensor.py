# SPDX-License-Identifier: Apache-2.0
"""register_torch_tensor: duck-typed (no torch needed), real CPU tensors and CUDA
tensors (skipped without torch / a GPU)."""
import subprocess
import sys

import numpy as np
import pytest

import ferry
from conftest import WAIT_MS, Pair, backend_under_test, pattern, plugin_available


class _Device:
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index


class FakeTensor:
    """Just what register_torch_tensor reads from a torch.Tensor, over a numpy array."""

    def __init__(self, arr, device="cpu"):
        self.arr = arr
        self.device = _Device(device)

    def is_contiguous(self):
        return self.arr.flags.c_contiguous

    def data_ptr(self):
        return self.arr.ctypes.data

    def numel(self):
        return self.arr.size

    def element_size(self):
        return self.arr.itemsize


def test_torch_is_not_imported():
    code = ("import sys, numpy, ferry\n"
            "e = ferry.IOEngine('t')\n"
            "class D: type='cpu'; index=None\n"
            "a = numpy.zeros(4)\n"
            "class T:\n"
            "  device=D()\n"
            "  def is_contiguous(s): return True\n"
            "  def data_ptr(s): return a.ctypes.data\n"
            "  def numel(s): return 4\n"
            "  def element_size(s): return 8\n"
            "e.register_torch_tensor(T())\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_fake_tensor_registration_and_transfer():
    p = Pair(1 << 16)
    try:
        arr = pattern(4096 * 4, 3).view(np.float32)
        t = FakeTensor(arr)
        m = p.initiator.register_torch_tensor(t)
        assert m.size == arr.nbytes and m.location == ferry.MemoryLocationType.CPU
        uid = p.initiator.allocate_transfer_uid()
        st = p.initiator.write(m, 0, p.remote_mem, 0, arr.nbytes, uid)
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
        assert np.array_equal(p.remote[: arr.nbytes], arr.view(np.uint8))
        p.initiator.deregister_memory(m)
        with pytest.raises(ValueError):
            p.initiator.register_torch_tensor(FakeTensor(np.zeros((8, 8))[:, ::2]))
        with pytest.raises(ValueError):
            p.initiator.register_torch_tensor(FakeTensor(np.zeros(0)))
        with pytest.raises(ValueError):
            p.initiator.register_torch_tensor(FakeTensor(np.zeros(4), device="meta"))
        with pytest.raises(TypeError):
            p.initiator.register_torch_tensor(np.zeros(4))
    finally:
        p.close()


try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                reason="needs torch with a CUDA GPU")


@needs_torch
def test_torch_cpu_tensor_write_and_read():
    p = Pair(1 << 20)
    try:
        t = torch.arange(1 << 16, dtype=torch.int32)
        m = p.initiator.register_torch_tensor(t)
        assert m.size == t.numel() * 4
        st = p.initiator.write(m, 0, p.remote_mem, 0, m.size, p.initiator.allocate_transfer_uid())
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
        assert np.array_equal(p.remote[: m.size].view(np.int32), t.numpy())
        t.zero_()
        st = p.initiator.read(m, 0, p.remote_mem, 0, m.size, p.initiator.allocate_transfer_uid())
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
        assert torch.equal(t, torch.arange(1 << 16, dtype=torch.int32))
        with pytest.raises(ValueError):
            p.initiator.register_torch_tensor(torch.zeros(8, 8).t())
    finally:
        p.close()


@needs_cuda
@pytest.mark.parametrize("op", ["write", "read"])
def test_cuda_tensor_transfer(op):
    """GPU memory on both sides: xgmi (GPU peer copies) where it loads, and tcp."""
    backends = [b for b in ("xgmi", backend_under_test()) if plugin_available(b)]
    p = Pair(4096, backend=backends)
    try:
        n = 1 << 20
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
        ms = p.initiator.register_torch_tensor(src if op == "write" else dst)
        md = p.target.register_torch_tensor(dst if op == "write" else src)
        assert ms.location == ferry.MemoryLocationType.GPU and ms.device == 0
        remote = ferry.MemoryDesc.unpack(md.pack())
        uid = p.initiator.allocate_transfer_uid()
        fn = p.initiator.write if op == "write" else p.initiator.read
        st = fn(ms, 0, remote, 0, n, uid)
        assert st.WaitFor(WAIT_MS) and st.Succeeded(), st.Message()
        torch.cuda.synchronize()
        assert torch.equal(src, dst)
    finally:
        p.close()
