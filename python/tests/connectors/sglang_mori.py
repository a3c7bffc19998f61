# SPDX-License-Identifier: Apache-2.0
"""SGLang's mori backend call sequence on `mori.io` (served by ferry), two processes.

What sglang/srt/disaggregation/mori/conn.py does with mori.io: both sides build
IOEngine(key, IOEngineConfig(host=ip, port=0)), an RDMA backend from
RdmaBackendConfig(qp, post_batch, workers, PollCqMode.POLLING, False) (five
positional arguments) and assert get_engine_desc().port > 0. They register raw
pointers: each layer's K and V buffers with register_memory(ptr, len, gpu_id,
MemoryLocationType.GPU) (CPU here without a GPU) and the aux buffers with
register_memory(ptr, len, -1, MemoryLocationType.CPU). Decode sends its packed
EngineDesc and MemoryDescs; prefill unpacks them and registers decode (decode
never registers prefill). Prefill moves every chunk with engine-level
batch_write([src], [offsets], [dst], [offsets], [sizes], [uid]) per layer and K/V,
the aux data with one batch_write of several entries, and waits with
engine.wait_all(statuses, timeout_ms=...) until it is not IN_PROGRESS; then it
reports success to decode over the side channel (SGLang's ZMQ).
"""

import os
import sys

from mori.cpp import TransferStatus  # noqa: F401  (SGLang imports it for annotations)
from mori.io import (BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc,
                     MemoryLocationType, PollCqMode, RdmaBackendConfig, StatusCode)

import replay

AUX_ITEMS, AUX_BYTES = 4, 256


def make_engine(role):
    cfg = IOEngineConfig(host="127.0.0.1", port=0)
    key = f"io-{role}-dp0-tp0-pid{os.getpid()}-127.0.0.1-{os.urandom(4).hex()}"
    engine = IOEngine(key, cfg)
    poll = PollCqMode.POLLING
    engine.create_backend(BackendType.RDMA, RdmaBackendConfig(1, -1, 1, poll, False))
    assert engine.get_engine_desc().port > 0, "the engine's port is not bound"
    print(f"{role}: mori engine {key} poll_cq_mode={poll.name}", file=sys.stderr)
    return engine


def register(engine, kv, aux, gpu_id):
    """MHA layout: [K of every layer..., V of every layer...], then the aux buffers."""
    loc = MemoryLocationType.GPU if gpu_id >= 0 else MemoryLocationType.CPU
    kv_descs = []
    for half in (0, 1):
        for t in kv.values():
            buf = t[half]
            kv_descs.append(engine.register_memory(buf.data_ptr(), buf.numel(), gpu_id, loc))
    aux_descs = [engine.register_memory(a.data_ptr(), a.numel(), -1, MemoryLocationType.CPU)
                 for a in aux]
    return kv_descs, aux_descs


def make_aux():
    torch = replay.torch_module()
    return [torch.zeros(AUX_ITEMS * AUX_BYTES, dtype=torch.uint8) for _ in range(2)]


def plan(src_blocks, dst_blocks, item_len):
    """Contiguous runs of (src page, dst page): offsets = start * item_len."""
    lo, ro, sz = replay.runs(src_blocks, dst_blocks, item_len, 0)
    n = len(lo) // 2
    return lo[:n], ro[:n], sz[:n]  # one half: K and V are separate regions here


def wait_chunk(engine, statuses):
    while True:
        rc = engine.wait_all(statuses, timeout_ms=50)
        if rc != StatusCode.IN_PROGRESS:
            break
    if rc != StatusCode.SUCCESS:
        reasons = [st.Message() for st in statuses if st.Failed()]
        return f"chunk failed ({rc}): {reasons[:1]}"
    return None


def prefill(args, ch):
    kv, aux = replay.make_kv(args), make_aux()
    gpu_id = 0 if args.device.startswith("cuda") else -1
    engine = make_engine("prefill")
    kv_descs, aux_descs = register(engine, kv, aux, gpu_id)
    src_blocks = replay.pick_blocks(args.request_blocks, args.blocks, 3)
    replay.fill(kv, src_blocks, args.block_bytes)
    for i, a in enumerate(aux):
        a.copy_(replay.torch_module().from_numpy(replay.pattern(a.numel(), 900 + i)))

    # Bootstrap: decode's engine and memory descriptors.
    peer = ch.recv()
    desc = EngineDesc.unpack(peer["engine_desc"])
    dst_kv = [MemoryDesc.unpack(b) for b in peer["kv"]]
    dst_aux = [MemoryDesc.unpack(b) for b in peer["aux"]]
    engine.register_remote_engine(desc)
    req = ch.recv()  # {"room", "engine_key", "kv_indices", "aux_index"}
    assert req["engine_key"] == desc.key

    # Two chunks, as a long prompt is sent: each posts per layer and K/V, then waits.
    err = None
    half = len(src_blocks) // 2
    for chunk in ((0, half), (half, len(src_blocks))):
        statuses = []
        s, d = src_blocks[chunk[0]:chunk[1]], req["kv_indices"][chunk[0]:chunk[1]]
        lo, ro, sz = plan(s, d, args.block_bytes)
        for src_md, dst_md in zip(kv_descs, dst_kv):
            if not sz:
                continue
            uid = engine.allocate_transfer_uid()
            statuses += engine.batch_write([src_md], [lo], [dst_md], [ro], [sz], [uid])
        err = err or wait_chunk(engine, statuses)
    # aux: one batch_write with an entry per aux buffer (SGLANG_MORI_SEND_AUX_RDMA).
    idx = req["aux_index"]
    uids = [engine.allocate_transfer_uid() for _ in aux_descs]
    statuses = engine.batch_write(aux_descs, [[idx * AUX_BYTES]] * len(aux_descs), dst_aux,
                                  [[idx * AUX_BYTES]] * len(aux_descs),
                                  [[AUX_BYTES]] * len(aux_descs), uids)
    assert len(statuses) == len(aux_descs)
    err = err or wait_chunk(engine, statuses)
    ch.send({"room": req["room"], "status": "Success" if err is None else "Failed",
             "reason": err})
    verdict = ch.recv()
    for e in ([err] if err else []) + verdict:
        print("prefill:", e, file=sys.stderr)
    return err is None and not verdict


def decode(args, ch):
    torch = replay.torch_module()
    kv, aux = replay.make_kv(args), make_aux()
    gpu_id = 0 if args.device.startswith("cuda") else -1
    engine = make_engine("decode")
    kv_descs, aux_descs = register(engine, kv, aux, gpu_id)
    ch.send({"engine_desc": engine.get_engine_desc().pack(),
             "kv": [m.pack() for m in kv_descs], "aux": [m.pack() for m in aux_descs]})
    dst_blocks = replay.pick_blocks(args.request_blocks, args.blocks, 4)
    aux_index = 2
    ch.send({"room": 7, "engine_key": engine.get_engine_desc().key, "kv_indices": dst_blocks,
             "aux_index": aux_index})
    done = ch.recv()
    verdict = [] if done["status"] == "Success" else [f"prefill reported {done}"]
    verdict += replay.check(kv, dst_blocks, args.block_bytes)
    for i, a in enumerate(aux):
        want = torch.from_numpy(replay.pattern(a.numel(), 900 + i))
        sl = slice(aux_index * AUX_BYTES, (aux_index + 1) * AUX_BYTES)
        if not torch.equal(a[sl], want[sl]):
            verdict.append(f"aux buffer {i} item {aux_index} differs")
        rest = a.clone()
        rest[sl] = 0
        if rest.any():
            verdict.append(f"aux buffer {i} changed outside item {aux_index}")
    ch.send(verdict)
    for e in verdict:
        print("decode:", e, file=sys.stderr)
    return not verdict


if __name__ == "__main__":
    sys.exit(replay.main(prefill, decode))
