# SPDX-License-Identifier: Apache-2.0
"""SGLang's nixl backend call sequence on `nixl._api` (served by ferry), two processes.

What sglang/srt/disaggregation/nixl/conn.py does with NIXL: each side makes
nixl_agent(name, nixl_agent_config(backends=[], num_threads=N,
sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)), then
create_backend("UCX", {"num_threads": "8"}) and checks "UCX" is in
get_plugin_list(). It registers the KV buffers (K and V of every layer) with
register_memory([(ptr, len, gpu, "")], "VRAM") ("DRAM" here without a GPU) and the
aux buffers with register_memory(..., "DRAM"), each result tested with `if not`.
Decode sends agent.name and get_agent_metadata(); prefill loads it with
add_remote_agent (decode never loads prefill's) and prepares both sides once as
Nx3 uint64 arrays: prep_xfer_dlist("", ..., "VRAM") and
prep_xfer_dlist(peer_name, ...). Every chunk is make_prepped_xfer("WRITE", src,
int32 ids, dst, int32 ids, b"<room>_kv_<chunk>_<is_last>_<rank>") + transfer(),
posted from worker threads sharing the agent and busy-polled with
check_xfer_state until "DONE"; the aux data goes with initialize_xfer(..., b"<room>_aux")
and a staging copy with no message (b""). Decode learns everything from
get_new_notifs() alone and reads the KV cache as soon as the last message came.
"""

import sys
import threading
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from nixl._bindings import nixlBackendError, nixlCancelledError, nixlRemoteDisconnectError

import replay

TRANSPORT_ERRORS = (nixlBackendError, nixlCancelledError, nixlRemoteDisconnectError)
TIMEOUT_S = 30
AUX_BYTES = 512
ROOM = 42
CHUNKS = 4


def make_agent(name, num_threads):
    cfg = nixl_agent_config(backends=[], num_threads=num_threads,
                            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    agent = nixl_agent(name, cfg)
    agent.create_backend("UCX", {"num_threads": "8"})
    assert "UCX" in agent.get_plugin_list()
    return agent


def register(agent, kv, aux, memtype):
    regions = [t[half] for half in (0, 1) for t in kv.values()]  # [K..., V...]
    gpu = max(regions[0].get_device(), 0)
    kv_descs = agent.register_memory([(r.data_ptr(), r.numel(), gpu, "") for r in regions], memtype)
    if not kv_descs:
        raise RuntimeError("NIXL memory registration failed for kv")
    aux_descs = agent.register_memory([(aux.data_ptr(), aux.numel(), 0, "")], "DRAM")
    if not aux_descs:
        raise RuntimeError("NIXL memory registration failed for aux")
    return regions, gpu, kv_descs, aux_descs


def slot_array(bases, blocks, block_len, gpu):
    """Nx3 uint64 (addr, len, gpu) of every (region, slot): index = region * blocks + slot."""
    rows = [(b + s * block_len, block_len, gpu) for b in bases for s in range(blocks)]
    return np.array(rows, dtype=np.uint64)


def prefill(args, ch):
    torch = replay.torch_module()
    memtype = "VRAM" if args.device.startswith("cuda") else "DRAM"
    kv = replay.make_kv(args)
    aux = torch.from_numpy(replay.pattern(AUX_BYTES * 4, 77).copy())
    stage = torch.from_numpy(replay.pattern(AUX_BYTES, 78).copy())
    agent = make_agent("prefill-" + str(args.blocks), 8)
    regions, gpu, kv_descs, aux_descs = register(agent, kv, aux, memtype)
    stage_descs = agent.register_memory([(stage.data_ptr(), stage.numel(), 0, "")], "DRAM")
    src_blocks = replay.pick_blocks(args.request_blocks, args.blocks, 7)
    replay.fill(kv, src_blocks, args.block_bytes)

    peer = ch.recv()
    agent.add_remote_agent(peer["metadata"])
    peer_name = peer["name"]
    src = agent.prep_xfer_dlist("", slot_array([r.data_ptr() for r in regions], args.blocks,
                                               args.block_bytes, gpu), memtype)
    dst = agent.prep_xfer_dlist(peer_name, slot_array(peer["kv_ptrs"], args.blocks,
                                                      args.block_bytes, peer["gpu"]), memtype)
    n_regions = len(regions)
    dst_blocks = peer["kv_indices"]

    def post_chunk(chunk_id, errors):
        lo, hi = (len(src_blocks) * chunk_id // CHUNKS, len(src_blocks) * (chunk_id + 1) // CHUNKS)
        s_idx = np.array([r * args.blocks + b for r in range(n_regions) for b in src_blocks[lo:hi]],
                         dtype=np.int32)
        d_idx = np.array([r * args.blocks + b for r in range(n_regions) for b in dst_blocks[lo:hi]],
                         dtype=np.int32)
        notif = f"{ROOM}_kv_{chunk_id}_{int(chunk_id == CHUNKS - 1)}_0"
        try:
            h = agent.make_prepped_xfer("WRITE", src, s_idx, dst, d_idx, notif.encode("ascii"))
            if not h:
                raise RuntimeError("make_prepped_xfer failed")
            if agent.transfer(h) == "ERR":
                raise RuntimeError("KVSender failed to post transfer")
            deadline = time.monotonic() + TIMEOUT_S
            while agent.check_xfer_state(h) != "DONE":
                if time.monotonic() > deadline:
                    raise RuntimeError("chunk timed out")
                time.sleep(0)
        except TRANSPORT_ERRORS as e:
            errors.append(f"chunk {chunk_id}: transport error {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"chunk {chunk_id}: {e}")

    # The transfer worker threads share one agent (NIXL_THREAD_SYNC_STRICT).
    errors = []
    workers = [threading.Thread(target=post_chunk, args=(c, errors)) for c in range(CHUNKS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    # A staging copy with no message: it must not show up at decode.
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(stage.data_ptr(), AUX_BYTES, 0)],
                                                            "DRAM"),
                              agent.get_xfer_descs([(peer["stage_ptr"], AUX_BYTES, 0)], "DRAM"),
                              peer_name, b"")
    agent.transfer(h)
    while agent.check_xfer_state(h) != "DONE":
        time.sleep(0)
    agent.release_xfer_handle(h)
    # The aux item, last, with its message.
    idx = peer["aux_index"]
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(
        [(aux.data_ptr() + idx * AUX_BYTES, AUX_BYTES, 0)], "DRAM"),
        agent.get_xfer_descs([(peer["aux_ptr"] + idx * AUX_BYTES, AUX_BYTES, 0)], "DRAM"),
        peer_name, f"{ROOM}_aux".encode())
    if agent.transfer(h) == "ERR":
        errors.append("aux post failed")
    while agent.check_xfer_state(h) != "DONE":
        time.sleep(0)
    verdict = ch.recv()
    agent.deregister_memory(stage_descs)
    for e in errors + verdict:
        print("prefill:", e, file=sys.stderr)
    return not errors and not verdict


def decode(args, ch):
    torch = replay.torch_module()
    memtype = "VRAM" if args.device.startswith("cuda") else "DRAM"
    kv = replay.make_kv(args)
    aux = torch.zeros(AUX_BYTES * 4, dtype=torch.uint8)
    stage = torch.zeros(AUX_BYTES, dtype=torch.uint8)
    agent = make_agent("decode-" + str(args.blocks), 0)
    regions, gpu, kv_descs, aux_descs = register(agent, kv, aux, memtype)
    agent.register_memory([(stage.data_ptr(), stage.numel(), 0, "")], "DRAM")
    dst_blocks = replay.pick_blocks(args.request_blocks, args.blocks, 8)
    aux_index = 1
    ch.send({"name": agent.name, "metadata": agent.get_agent_metadata(),
             "kv_ptrs": [r.data_ptr() for r in regions], "gpu": gpu, "kv_indices": dst_blocks,
             "aux_ptr": aux.data_ptr(), "aux_index": aux_index, "stage_ptr": stage.data_ptr()})

    # KVReceiver.poll: the room is done when every chunk's and the aux message came.
    chunks, aux_done, other, errors = set(), False, [], []
    deadline = time.monotonic() + TIMEOUT_S
    while not (len(chunks) == CHUNKS and aux_done) and time.monotonic() < deadline:
        for peer_name, msgs in agent.get_new_notifs().items():
            for m in msgs:
                parts = m.decode("ascii").split("_")
                if parts[:2] == [str(ROOM), "kv"]:
                    if int(parts[2]) in chunks:
                        errors.append(f"chunk {parts[2]} notified twice")
                    chunks.add(int(parts[2]))
                elif parts == [str(ROOM), "aux"]:
                    aux_done = True
                else:
                    other.append(m)
        time.sleep(0.0005)
    if not (len(chunks) == CHUNKS and aux_done):
        errors.append(f"room not complete: chunks {sorted(chunks)}, aux {aux_done}")
    # Read at once: a message means its data had landed.
    errors += replay.check(kv, dst_blocks, args.block_bytes)
    want_aux = torch.from_numpy(replay.pattern(AUX_BYTES * 4, 77).copy())
    sl = slice(aux_index * AUX_BYTES, (aux_index + 1) * AUX_BYTES)
    if not torch.equal(aux[sl], want_aux[sl]) or aux[:sl.start].any() or aux[sl.stop:].any():
        errors.append("aux buffer wrong")
    if not torch.equal(stage, torch.from_numpy(replay.pattern(AUX_BYTES, 78).copy())):
        errors.append("staging copy missing")
    errors += [f"unexpected message {m!r}" for m in other]
    if agent.get_new_notifs():
        errors.append("a message after the room's last (the staging copy had none)")
    ch.send(errors)
    for e in errors:
        print("decode:", e, file=sys.stderr)
    return not errors


if __name__ == "__main__":
    sys.exit(replay.main(prefill, decode))
