#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""KV-cache transfer between a prefill and a decode process, as a PD-disaggregated
inference server does it (vLLM's MoRIIOConnector flow), with ferry.

Both processes hold a paged KV cache: `layers` tensors of `blocks` x `block_bytes`.
A request's KV lives in a few blocks, whose ids differ on the two sides. The two
processes exchange engine and memory descriptors and control messages over a side
channel (here a socket pair; in a server, the connector's handshake/notify ports).

WRITE mode (the default in vLLM):
  decode allocates blocks for the request and sends their ids; prefill computes layer
  by layer and, as each layer finishes, writes that layer's blocks into decode's cache
  (one batch_write per layer, notify on); decode waits for each layer's inbound status,
  checks the layer, and prefill sends "done" once every write has succeeded.
READ mode:
  prefill computes all layers, then tells decode "blocks ready" with its block ids;
  decode reads every layer's blocks (one batch_read per layer), verifies them and
  tells prefill to free its blocks.

Every block is verified against the content prefill computed. Exit code 0 on success.

  PYTHONPATH=build/python FERRY_PLUGIN_PATH=build/lib/ferry/plugins \\
      python3 examples/kv_transfer.py --mode both
  python3 examples/kv_transfer.py --mode write --device cuda      # CUDA tensors (torch)
"""
import argparse
import base64
import json
import os
import socket
import struct
import subprocess
import sys
import time
import zlib

import numpy as np

import ferry

# ---- the side channel: length-prefixed JSON, bytes as base64 ---------------------------


class Channel:
    def __init__(self, sock, timeout_s):
        self.sock = sock
        self.sock.settimeout(timeout_s)  # every receive is bounded

    @staticmethod
    def _enc(o):
        if isinstance(o, bytes):
            return {"__b": base64.b64encode(o).decode()}
        if isinstance(o, dict):
            return {k: Channel._enc(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [Channel._enc(v) for v in o]
        return o

    @staticmethod
    def _dec(o):
        if isinstance(o, dict):
            if set(o) == {"__b"}:
                return base64.b64decode(o["__b"])
            return {k: Channel._dec(v) for k, v in o.items()}
        if isinstance(o, list):
            return [Channel._dec(v) for v in o]
        return o

    def send(self, **msg):
        body = json.dumps(self._enc(msg)).encode()
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the other process closed the side channel")
            buf += chunk
        return buf

    def recv(self, expect):
        (n,) = struct.unpack(">I", self._exact(4))
        msg = self._dec(json.loads(self._exact(n)))
        if msg.get("type") != expect:
            raise RuntimeError(f"expected a '{expect}' message, got {msg}")
        return msg


# ---- the paged KV cache ----------------------------------------------------------------


def block_content(request, layer, blocks, block_bytes):
    """What prefill computes for `blocks` token blocks of `layer` (uint8, blocks x block_bytes)."""
    seed = zlib.crc32(f"{request}/{layer}".encode()) * 0x9E3779B97F4A7C15 % (1 << 64)
    x = np.arange(blocks * block_bytes, dtype=np.uint64) + np.uint64(seed)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    return (x >> np.uint64(56)).astype(np.uint8).reshape(blocks, block_bytes)


class KVCache:
    """layers x blocks x block_bytes, one registered region per layer (as vLLM registers
    one tensor per layer). numpy on CPU, torch CUDA tensors with device='cuda:N'."""

    def __init__(self, engine, layers, blocks, block_bytes, device):
        self.block_bytes, self.blocks, self.device = block_bytes, blocks, device
        self.free = list(range(blocks))
        if device == "cpu":
            self.torch = None
            self.storage = np.zeros((layers, blocks, block_bytes), dtype=np.uint8)
            self.layers = [self.storage[i] for i in range(layers)]
            self.mems = [engine.register_buffer(t) for t in self.layers]
        else:
            import torch  # only in --device cuda

            self.torch = torch
            self.layers = [torch.zeros((blocks, block_bytes), dtype=torch.uint8, device=device)
                           for _ in range(layers)]
            self.mems = [engine.register_torch_tensor(t) for t in self.layers]
        self.engine = engine

    def allocate(self, n, rng):
        if n > len(self.free):
            raise RuntimeError("out of KV blocks")
        picked = rng.choice(len(self.free), size=n, replace=False)
        ids = [self.free[i] for i in picked]
        for b in ids:
            self.free.remove(b)
        return ids  # deliberately unordered: the two sides' ids never line up

    def release(self, ids):
        self.free.extend(ids)

    def store(self, layer, ids, content):
        if self.torch is None:
            self.layers[layer][ids] = content
        else:
            idx = self.torch.tensor(ids, device=self.device)
            self.layers[layer][idx] = self.torch.from_numpy(content).to(self.device)

    def load(self, layer, ids):
        if self.torch is None:
            return self.layers[layer][ids]
        self.torch.cuda.synchronize(self.device)
        return self.layers[layer][self.torch.tensor(ids, device=self.device)].cpu().numpy()

    def untouched(self, layer, used):
        """True when every block outside `used` is still zero (no stray bytes landed)."""
        others = sorted(set(range(self.blocks)) - set(used))
        return not self.load(layer, others).any() if others else True

    def offsets(self, ids):
        return [b * self.block_bytes for b in ids]

    def close(self):
        for m in self.mems:
            self.engine.deregister_memory(m)


def check(cond, what):
    if not cond:
        raise RuntimeError(what)


def wait_ok(statuses, timeout_s, what):
    check(ferry.wait_all(statuses, timeout_ms=timeout_s * 1000), f"{what}: not done in {timeout_s}s")
    for s in statuses:
        check(s.Succeeded(), f"{what}: {s.Code().name}: {s.Message()}")


# ---- the two roles ---------------------------------------------------------------------


def setup(role, args, chan):
    cfg = ferry.IOEngineConfig(host="127.0.0.1", port=0, timeout_ms=args.timeout * 1000)
    engine = ferry.IOEngine(f"{role}-0", cfg)
    for backend in args.backend.split(","):
        engine.create_backend(backend.strip())
    device = args.device
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        check(n > 0, "--device cuda: no CUDA device")
        device = f"cuda:{0 if role == 'prefill' else 1 % n}"
    cache = KVCache(engine, args.layers, args.blocks, args.block_bytes, device)
    # Handshake: engine descriptors and the per-layer memory descriptors.
    chan.send(type="hello", engine=engine.get_engine_desc().pack(),
              layers=[m.pack() for m in cache.mems])
    hello = chan.recv("hello")
    peer = ferry.EngineDesc.unpack(hello["engine"])
    engine.register_remote_engine(peer)
    peer_layers = [ferry.MemoryDesc.unpack(b) for b in hello["layers"]]
    check(len(peer_layers) == args.layers, "the two sides disagree on the layer count")
    return engine, cache, peer.key, peer_layers


def shutdown(engine, cache, peer_key, chan, initiator):
    """Leave in order: the initiator forgets the target first, then the target the
    initiator, so no side sees its connections cut under it."""
    if initiator:
        engine.deregister_remote_engine(peer_key)
        chan.send(type="bye")
        chan.recv("bye")
    else:
        chan.recv("bye")
        engine.deregister_remote_engine(peer_key)
        chan.send(type="bye")
    cache.close()
    engine.close()


def prefill(args, chan):
    engine, cache, decode_key, decode_layers = setup("prefill", args, chan)
    rng = np.random.default_rng(1)
    req = "req-0"
    bb = args.block_bytes
    if args.mode == "write":
        alloc = chan.recv("alloc")  # decode's block ids for the request
        d_ids = alloc["blocks"]
        p_ids = cache.allocate(len(d_ids), rng)
        uids = [engine.allocate_transfer_uid() for _ in range(args.layers)]
        chan.send(type="plan", req=req, uids=uids)
        statuses = []
        for layer in range(args.layers):
            # "Compute" the layer, then write its blocks while the next layer computes.
            cache.store(layer, p_ids, block_content(req, layer, len(p_ids), bb))
            st = engine.batch_write(cache.mems[layer], cache.offsets(p_ids), decode_layers[layer],
                                    [b * bb for b in d_ids], [bb] * len(d_ids), uids[layer],
                                    notify=True)
            check(not st.Failed(), f"layer {layer} write: {st.Message()}")
            statuses.append(st)
        wait_ok(statuses, args.timeout, "prefill writes")
        chan.send(type="done", req=req)  # every write landed: decode may use the blocks
        chan.recv("ack")
        cache.release(p_ids)
    else:
        # Compute every layer into prefill's own blocks, then announce them.
        p_ids = cache.allocate(args.request_blocks, rng)
        for layer in range(args.layers):
            cache.store(layer, p_ids, block_content(req, layer, len(p_ids), bb))
        chan.send(type="ready", req=req, blocks=p_ids)
        free = chan.recv("free")  # decode has read them all
        # Reads were issued with notify: each one is recorded here, on their target.
        for uid in free["uids"]:
            st = engine.wait_inbound(decode_key, uid, timeout_ms=args.timeout * 1000)
            check(st is not None and st.Succeeded(), f"no inbound status for read {uid}")
        cache.release(p_ids)
    check(len(cache.free) == args.blocks, "prefill leaked blocks")
    shutdown(engine, cache, decode_key, chan, initiator=args.mode == "write")
    print(f"[prefill] {args.mode.upper()} mode: served {req}", flush=True)


def decode(args, chan):
    engine, cache, prefill_key, prefill_layers = setup("decode", args, chan)
    rng = np.random.default_rng(2)
    req = "req-0"
    bb = args.block_bytes
    t0 = time.monotonic()
    if args.mode == "write":
        d_ids = cache.allocate(args.request_blocks, rng)
        chan.send(type="alloc", req=req, blocks=d_ids)
        plan = chan.recv("plan")
        for layer, uid in enumerate(plan["uids"]):
            # Layer by layer, as the writes land.
            st = engine.wait_inbound(prefill_key, uid, timeout_ms=args.timeout * 1000)
            check(st is not None, f"layer {layer}: no inbound status within {args.timeout}s")
            check(st.Succeeded(), f"layer {layer}: {st.Message()}")
            got = cache.load(layer, d_ids)
            check(np.array_equal(got, block_content(req, layer, len(d_ids), bb)),
                  f"layer {layer}: wrong KV bytes")
        chan.recv("done")
        chan.send(type="ack", req=req)
    else:
        ready = chan.recv("ready")
        p_ids = ready["blocks"]
        d_ids = cache.allocate(len(p_ids), rng)
        uids, statuses = [], []
        for layer in range(args.layers):
            uid = engine.allocate_transfer_uid()
            st = engine.batch_read(cache.mems[layer], cache.offsets(d_ids), prefill_layers[layer],
                                   [b * bb for b in p_ids], [bb] * len(p_ids), uid, notify=True)
            uids.append(uid)
            statuses.append(st)
        wait_ok(statuses, args.timeout, "decode reads")
        for layer in range(args.layers):
            got = cache.load(layer, d_ids)
            check(np.array_equal(got, block_content(req, layer, len(d_ids), bb)),
                  f"layer {layer}: wrong KV bytes")
        chan.send(type="free", req=req, uids=uids)
    for layer in range(args.layers):
        check(cache.untouched(layer, d_ids), f"layer {layer}: bytes landed outside the request")
    ms = (time.monotonic() - t0) * 1000
    total = args.layers * len(d_ids) * bb
    cache.release(d_ids)
    shutdown(engine, cache, prefill_key, chan, initiator=args.mode == "read")
    print(f"[decode] {args.mode.upper()} mode: {args.layers} layers x {len(d_ids)} blocks x "
          f"{bb} B verified ({total / 2**20:.1f} MiB; {ms:.0f} ms end to end, pattern generation "
          "and checks included)", flush=True)


# ---- launcher ----------------------------------------------------------------------------


def run_mode(args, mode):
    """Starts prefill and decode as two OS processes joined by a socket pair."""
    a, b = socket.socketpair()
    procs = []
    base = [sys.executable, os.path.abspath(__file__), "--mode", mode,
            "--layers", str(args.layers), "--blocks", str(args.blocks),
            "--block-bytes", str(args.block_bytes), "--request-blocks", str(args.request_blocks),
            "--device", args.device, "--backend", args.backend, "--timeout", str(args.timeout)]
    for role, s in (("prefill", a), ("decode", b)):
        procs.append(subprocess.Popen(base + ["--role", role, "--fd", str(s.fileno())],
                                      pass_fds=(s.fileno(),)))
    a.close()
    b.close()
    deadline = time.monotonic() + 3 * args.timeout + 60
    codes = [None, None]
    try:
        while None in codes:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    try:
                        codes[i] = p.wait(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        pass
            if time.monotonic() > deadline:
                raise TimeoutError
    except (TimeoutError, KeyboardInterrupt):
        pass
    finally:
        for p in procs:  # a side that is still there after the deadline is stuck
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    ok = codes == [0, 0]
    print(f"{mode.upper()} mode: {'OK' if ok else f'FAILED (prefill {codes[0]}, decode {codes[1]})'}",
          flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["write", "read", "both"], default="both")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=64, help="KV blocks per layer on each side")
    ap.add_argument("--block-bytes", type=int, default=16384)
    ap.add_argument("--request-blocks", type=int, default=24, help="blocks the request uses")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backend", default=None,
                    help="backend(s), comma-separated; default tcp, or xgmi,tcp with --device cuda")
    ap.add_argument("--timeout", type=int, default=60, help="seconds any single wait may take")
    ap.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backend is None:
        args.backend = "xgmi,tcp" if args.device == "cuda" else "tcp"
    if args.request_blocks > args.blocks:
        ap.error("--request-blocks exceeds --blocks")
    if args.role:
        chan = Channel(socket.socket(fileno=args.fd), args.timeout)
        try:
            (prefill if args.role == "prefill" else decode)(args, chan)
            return 0
        except Exception as e:  # noqa: BLE001  (report and fail this side)
            print(f"[{args.role}] FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return 1
    if args.device == "cuda":
        try:
            import torch
        except ImportError:
            print("--device cuda needs torch", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device", file=sys.stderr)
            return 2
    modes = ["write", "read"] if args.mode == "both" else [args.mode]
    return 0 if all([run_mode(args, m) for m in modes]) else 1


if __name__ == "__main__":
    sys.exit(main())
