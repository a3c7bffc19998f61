# SPDX-License-Identifier: Apache-2.0
"""vLLM's MoRIIOConnector call sequence on `mori.io` (served by ferry), two processes.

What the connector does with mori.io, in its order (vllm .../kv_connector/v1/moriio):
both workers build IOEngine(key, IOEngineConfig(ip, kv_port)) and an RDMA backend
from RdmaBackendConfig(qp, post_batch, workers, PollCqMode.POLLING,
enable_notification=False), register each layer's KV tensor with
register_torch_tensor (or, --shared-region, one region over every layer, with
per-layer offsets taken from MemoryDesc.data) and publish
get_engine_desc().pack() plus the packed MemoryDescs. The initiator alone
registers the other engine (EngineDesc.unpack -> register_remote_engine) and makes
one session per layer. WRITE mode: decode sends its block ids, prefill posts one
session.batch_write per layer with allocate_transfer_uid(), polls
Succeeded()/Failed() every millisecond, then tells decode "write_done". READ mode:
prefill sends its block ids, decode posts one session.batch_read per layer
(re-posting on "SQ full"), polls, checks and sends "release". Completion
signalling is the side channel's (the connector's ZMQ), never mori's.
"""

import sys
import time

from mori.io import (BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, PollCqMode,
                     RdmaBackendConfig, XgmiBackendConfig)

import replay

TRANSFER_TIMEOUT_S = 30


def extra(ap):
    ap.add_argument("--backend", default="rdma", choices=["rdma", "xgmi"])
    ap.add_argument("--shared-region", action="store_true")


def make_engine(args, role):
    ip = "127.0.0.1"
    key = f"{'producer' if role == 'prefill' else 'consumer'}:{ip}:{replay.get_open_port()}:tp0:dp0"
    engine = IOEngine(key, IOEngineConfig(ip, replay.get_open_port()))
    if args.backend == "xgmi":
        engine.create_backend(BackendType.XGMI, XgmiBackendConfig())
    else:
        engine.create_backend(BackendType.RDMA,
                              RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING,
                                                enable_notification=False))
    return engine


def register(engine, kv, args):
    """layer -> [packed MemoryDesc], layer -> byte offset of the layer in its region,
    and each layer's base address (kv_caches_base_addr)."""
    torch = replay.torch_module()
    meta, layer_off, bases = {}, {}, []
    if args.shared_region:
        # The newest connector: every layer in one storage, registered once.
        first = next(iter(kv.values()))
        per = first.numel()
        whole = torch.zeros(per * len(kv), dtype=torch.uint8, device=first.device)
        for i, name in enumerate(list(kv)):
            kv[name] = whole[i * per:(i + 1) * per].view(first.shape)
        md = engine.register_torch_tensor(whole)
        packed = md.pack()
        for name, t in kv.items():
            meta[name] = [packed]
            layer_off[name] = t.data_ptr() - md.data
            bases.append(t.data_ptr())
    else:
        for name, t in kv.items():
            md = engine.register_torch_tensor(t)
            if md is None:
                raise RuntimeError(f"register_torch_tensor({name}) returned None")
            meta[name] = [md.pack()]
            layer_off[name] = 0
            bases.append(t.data_ptr())
    return meta, layer_off, bases


def handshake_reply(ch, engine, meta, bases, args):
    ch.send({"agent_metadata": engine.get_engine_desc().pack(), "kv_caches_base_addr": bases,
             "num_blocks": args.blocks, "block_len": args.block_bytes})
    ch.send(meta)


def handshake_initiate(ch, engine):
    info, remote_meta = ch.recv(), ch.recv()
    desc = EngineDesc.unpack(info["agent_metadata"])
    engine.register_remote_engine(desc)
    return desc.key, info, remote_meta


def build_sessions(engine, local_meta, remote_meta):
    sessions = []
    for name in local_meta:
        local_md = MemoryDesc.unpack(local_meta[name][0])
        remote_md = MemoryDesc.unpack(remote_meta[name][0])
        sessions.append(engine.create_session(local_md, remote_md))
    return sessions


def remote_layer_offsets(info, remote_meta):
    # What the newest connector computes: base address minus the region's .data.
    return [info["kv_caches_base_addr"][i] - MemoryDesc.unpack(remote_meta[name][0]).data
            for i, name in enumerate(remote_meta)]


def wait_statuses(statuses):
    """The connector's loop: poll every millisecond until each succeeded or one failed."""
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S
    pending = list(statuses)
    while pending:
        for st in list(pending):
            if st.Succeeded():
                pending.remove(st)
            elif st.Failed():
                return f"transfer failed: {st.Message()} (code {st.Code()})"
        if time.monotonic() > deadline:
            return "transfer timed out"
        time.sleep(0.001)
    return None


def post_layers(engine, sessions, args, local_blocks, remote_blocks, local_off, remote_off, op):
    statuses = []
    half = args.blocks * args.block_bytes
    for i, sess in enumerate(sessions):
        lo, ro, sz = replay.runs(local_blocks, remote_blocks, args.block_bytes, half)
        lo = [x + local_off[i] for x in lo]
        ro = [x + remote_off[i] for x in ro]
        deadline = time.monotonic() + TRANSFER_TIMEOUT_S
        while True:
            uid = engine.allocate_transfer_uid()
            st = getattr(sess, op)(lo, ro, sz, uid)
            if st.Failed() and "SQ full" in st.Message() and time.monotonic() < deadline:
                time.sleep(0.001)
                continue
            break
        statuses.append(st)
    return statuses


def prefill(args, ch):
    kv = replay.make_kv(args)
    engine = make_engine(args, "prefill")
    meta, layer_off, bases = register(engine, kv, args)
    my_blocks = replay.pick_blocks(args.request_blocks, args.blocks, 1)
    replay.fill(kv, my_blocks, args.block_bytes)
    local_off = [layer_off[n] for n in kv]
    if args.mode == "write":
        _, info, remote_meta = handshake_initiate(ch, engine)
        sessions = build_sessions(engine, meta, remote_meta)
        req = ch.recv()  # {"type": "remote_blocks", "transfer_id", "block_notify_list"}
        assert req["type"] == "remote_blocks"
        statuses = post_layers(engine, sessions, args, my_blocks, req["block_notify_list"],
                               local_off, remote_layer_offsets(info, remote_meta), "batch_write")
        err = wait_statuses(statuses)
        ch.send({"type": "write_done", "transfer_id": req["transfer_id"], "error": err})
        verdict = ch.recv()
    else:
        handshake_reply(ch, engine, meta, bases, args)
        ch.send({"transfer_id": "req-1", "remote_block_ids": my_blocks})
        msg = ch.recv()  # decode frees prefill's blocks with "release"
        assert msg["type"] == "release" and msg["transfer_id"] == "req-1", msg
        err, verdict = None, msg["verdict"]
    # Prefill's blocks are intact after the transfer (WRITE reads them, READ is read).
    errors = replay.check(kv, my_blocks, args.block_bytes)
    for e in [err] + verdict + errors:
        if e:
            print("prefill:", e, file=sys.stderr)
    return not err and not verdict and not errors


def decode(args, ch):
    kv = replay.make_kv(args)
    engine = make_engine(args, "decode")
    meta, layer_off, bases = register(engine, kv, args)
    my_blocks = replay.pick_blocks(args.request_blocks, args.blocks, 2)
    local_off = [layer_off[n] for n in kv]
    if args.mode == "write":
        handshake_reply(ch, engine, meta, bases, args)
        ch.send({"type": "remote_blocks", "transfer_id": "req-1", "block_notify_list": my_blocks,
                 "decode_rank": 0})
        done = ch.recv()
        assert done["type"] == "write_done" and done["transfer_id"] == "req-1", done
        verdict = ([done["error"]] if done["error"] else []) + replay.check(kv, my_blocks,
                                                                           args.block_bytes)
        ch.send(verdict)
    else:
        _, info, remote_meta = handshake_initiate(ch, engine)
        sessions = build_sessions(engine, meta, remote_meta)
        req = ch.recv()
        statuses = post_layers(engine, sessions, args, my_blocks, req["remote_block_ids"],
                               local_off, remote_layer_offsets(info, remote_meta), "batch_read")
        err = wait_statuses(statuses)
        verdict = ([err] if err else []) + replay.check(kv, my_blocks, args.block_bytes)
        ch.send({"type": "release", "transfer_id": req["transfer_id"], "consumer_tp_size": 1,
                 "verdict": verdict})
    for e in verdict:
        print("decode:", e, file=sys.stderr)
    return not verdict


if __name__ == "__main__":
    sys.exit(replay.main(prefill, decode, extra))
