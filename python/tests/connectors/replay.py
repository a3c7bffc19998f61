# SPDX-License-Identifier: Apache-2.0
"""What the connector replays share: the side channel, the paged KV cache, the roles.

A replay is one script run twice: as prefill (this process) and as decode (a
second process it starts with exec, never fork: a process that initialised CUDA
must not use it in a forked child). The two talk over a socket pair the way the
connectors talk over ZMQ (handshake metadata, block ids, "done" / "release"),
and move the KV cache only through the package under test.

KV cache: per layer one tensor of shape (2, blocks, block_bytes) uint8 (K and V
halves, the flash-attention layout), CPU or CUDA. Block (layer, half, b) of a
request holds pattern(block_bytes, seed(layer, half, b)); decode checks every
block it received and that every other block stayed zero.
"""

import argparse
import os
import pickle
import socket
import struct
import subprocess
import sys

import numpy as np

TIMEOUT_S = 60


class Channel:
    """Length-prefixed pickles over a socket (both ends are this test's own processes)."""

    def __init__(self, sock):
        self.sock = sock
        self.sock.settimeout(TIMEOUT_S)

    def send(self, obj):
        data = pickle.dumps(obj)
        self.sock.sendall(struct.pack("<I", len(data)) + data)

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            part = self.sock.recv(n - len(buf))
            if not part:
                raise EOFError("the peer process closed the side channel")
            buf += part
        return buf

    def recv(self):
        (n,) = struct.unpack("<I", self._exact(4))
        return pickle.loads(self._exact(n))


def parse(extra=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--fd", type=int, default=-1)
    ap.add_argument("--mode", choices=["write", "read"], default="write")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-bytes", type=int, default=8192)
    ap.add_argument("--request-blocks", type=int, default=24)
    if extra:
        extra(ap)
    return ap.parse_args()


def start(args):
    """Prefill: start decode (exec) and return the channel to it. Decode: the channel."""
    if args.role == "decode":
        return Channel(socket.socket(fileno=args.fd)), None
    mine, theirs = socket.socketpair()
    argv = [sys.executable, sys.argv[0]] + [a for a in sys.argv[1:]]
    argv += ["--role", "decode", "--fd", str(theirs.fileno())]
    proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=dict(os.environ))
    theirs.close()
    return Channel(mine), proc


def finish(proc, ok):
    """Prefill waits for decode; the exit code is 0 only when both sides passed."""
    if proc is None:
        return 0 if ok else 1
    try:
        rc = proc.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        print("decode did not exit", file=sys.stderr)
        return 1
    if rc != 0:
        print(f"decode exited {rc}", file=sys.stderr)
    return 0 if ok and rc == 0 else 1


def torch_module():
    import torch

    return torch


def make_kv(args):
    """{layer name: tensor (2, blocks, block_bytes) uint8}, zeroed, on args.device."""
    torch = torch_module()
    dev = torch.device(args.device)
    return {f"model.layers.{i}.self_attn.attn": torch.zeros((2, args.blocks, args.block_bytes),
                                                            dtype=torch.uint8, device=dev)
            for i in range(args.layers)}


def seed(layer, half, block):
    return 1_000_003 * layer + 7_919 * half + block + 17


def pattern(n, s):
    x = np.arange(n, dtype=np.uint64) + np.uint64((s * 0x9E3779B97F4A7C15) % (1 << 64))
    x *= np.uint64(0xBF58476D1CE4E5B9)
    return (x >> np.uint64(56)).astype(np.uint8)


def fill(kv, blocks, block_bytes):
    """Prefill's computed KV: the request's blocks (its own block ids) get their pattern."""
    torch = torch_module()
    for li, t in enumerate(kv.values()):
        for half in (0, 1):
            for j, b in enumerate(blocks):
                t[half, b].copy_(torch.from_numpy(pattern(block_bytes, seed(li, half, j))))


def check(kv, blocks, block_bytes):
    """Decode: block j of the request (stored at decode's block id blocks[j]) holds
    prefill's block j; every block outside the request is still zero. Returns errors."""
    errors = []
    want_zero = set(range(next(iter(kv.values())).shape[1])) - set(blocks)
    for li, t in enumerate(kv.values()):
        host = t.cpu().numpy()
        for half in (0, 1):
            for j, b in enumerate(blocks):
                if not np.array_equal(host[half, b], pattern(block_bytes, seed(li, half, j))):
                    errors.append(f"layer {li} half {half} request block {j} (decode block {b})")
            for b in want_zero:
                if host[half, b].any():
                    errors.append(f"layer {li} half {half} block {b} outside the request changed")
    return errors


def pick_blocks(n, total, salt):
    """n distinct block ids out of total, some contiguous runs, some scattered."""
    rng = np.random.default_rng(salt)
    ids = sorted(rng.choice(total, size=n, replace=False).tolist())
    return ids


def runs(local_blocks, remote_blocks, block_len, half_bytes):
    """vLLM-style offsets for one layer: K and V halves, contiguous block runs merged.
    Returns (local_offsets, remote_offsets, sizes) of byte offsets into the layer tensor."""
    lo, ro, sz = [], [], []
    for half in (0, 1):
        base = half * half_bytes
        i = 0
        while i < len(local_blocks):
            j = i
            while (j + 1 < len(local_blocks) and local_blocks[j + 1] == local_blocks[j] + 1
                   and remote_blocks[j + 1] == remote_blocks[j] + 1):
                j += 1
            lo.append(base + local_blocks[i] * block_len)
            ro.append(base + remote_blocks[i] * block_len)
            sz.append((j - i + 1) * block_len)
            i = j + 1
    return lo, ro, sz


def get_open_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(prefill, decode, extra=None):
    """Run the replay's role: prefill starts decode and waits for it; exit 0 when both passed."""
    args = parse(extra)
    ch, proc = start(args)
    ok = (prefill if args.role == "prefill" else decode)(args, ch)
    return finish(proc, ok)
