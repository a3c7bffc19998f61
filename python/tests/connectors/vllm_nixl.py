# SPDX-License-Identifier: Apache-2.0
"""vLLM's NixlConnector call sequence on `nixl._api` (served by ferry), two processes.

What vllm/.../kv_connector/v1/nixl_connector.py does with NIXL: each worker makes
nixl_agent(str(uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True)),
registers its KV cache regions (K and V of every layer: (base, bytes, device, ""))
with get_reg_descs + register_memory(descs, backends=["UCX"]), prepares its own
per-block list with prep_xfer_dlist("NIXL_INIT_AGENT", get_xfer_descs(...)) and
publishes get_agent_metadata(). Decode (the reader) loads prefill's metadata with
add_remote_agent (a name in bytes, used as is from then on), prepares prefill's
block list, and for each request posts make_prepped_xfer("READ", ..., int64 ids,
notif_msg=b"<request>:<tp size>") + transfer(), polls check_xfer_state once per
step, reads get_xfer_telemetry on DONE and releases the handle. A request fully
served by decode's prefix cache gets send_notif alone. Prefill never loads
decode's metadata: it frees a request's blocks when get_new_notifs() brings its
message. Shutdown: release handles and lists, remove_remote_agent,
deregister_memory.
"""

import sys
import time
import uuid

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlXferTelemetry  # noqa: F401  (vLLM imports it for annotations)

import replay

STEP_S = 0.001
TIMEOUT_S = 30


def make_agent():
    cfg = nixl_agent_config(num_threads=4, capture_telemetry=True)
    return nixl_agent(str(uuid.uuid4()), cfg)


def regions(kv):
    """K and V of every layer, as the connector splits a flash-attention cache."""
    return [t[half] for t in kv.values() for half in (0, 1)]


def register_kv_caches(agent, kv, memtype, args):
    caches_data, bases = [], []
    for r in regions(kv):
        dev = max(r.get_device(), 0)
        caches_data.append((r.data_ptr(), r.numel(), dev, ""))
        bases.append(r.data_ptr())
    descs = agent.get_reg_descs(caches_data, memtype)
    agent.register_memory(descs, backends=["UCX"])
    dev = caches_data[0][2]
    blocks_data = [(base + b * args.block_bytes, args.block_bytes, dev)
                   for base in bases for b in range(args.blocks)]
    src = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks_data, memtype))
    meta = {"agent_metadata": agent.get_agent_metadata(), "kv_caches_base_addr": bases,
            "device_id": dev, "num_blocks": args.blocks, "block_len": args.block_bytes}
    return descs, src, meta


def desc_ids(blocks, num_regions, num_blocks):
    return np.array([r * num_blocks + b for r in range(num_regions) for b in blocks],
                    dtype=np.int64)


def prefill(args, ch):
    memtype = "VRAM" if args.device.startswith("cuda") else "DRAM"
    kv = replay.make_kv(args)
    agent = make_agent()
    descs, src, meta = register_kv_caches(agent, kv, memtype, args)
    blocks = replay.pick_blocks(args.request_blocks, args.blocks, 5)
    replay.fill(kv, blocks, args.block_bytes)
    ch.send(meta)
    ch.send({"request": "req-1", "remote_block_ids": blocks})
    ch.send({"request": "req-2", "remote_block_ids": []})  # decode's prefix cache has it all

    # get_finished on the producer: free a request once its consumer's message came.
    expected = {"req-1": 1, "req-2": 1}
    seen, freed, deadline = {}, [], time.monotonic() + TIMEOUT_S
    while len(freed) < len(expected) and time.monotonic() < deadline:
        for sender, msgs in agent.get_new_notifs().items():
            assert isinstance(sender, str) and all(isinstance(m, bytes) for m in msgs)
            for m in msgs:
                req_id, tp = m.decode().rsplit(":", 1)
                seen[req_id] = seen.get(req_id, 0) + 1
                if seen[req_id] == expected.get(req_id, -1) * int(tp):
                    freed.append(req_id)
        time.sleep(STEP_S)
    verdict = ch.recv()
    errors = [] if sorted(freed) == ["req-1", "req-2"] else [f"freed {freed}, saw {seen}"]
    errors += replay.check(kv, blocks, args.block_bytes)  # a READ source stays as it was
    agent.release_dlist_handle(src)
    agent.deregister_memory(descs)
    for e in verdict + errors:
        print("prefill:", e, file=sys.stderr)
    return not verdict and not errors


def decode(args, ch):
    memtype = "VRAM" if args.device.startswith("cuda") else "DRAM"
    kv = replay.make_kv(args)
    agent = make_agent()
    descs, src, _ = register_kv_caches(agent, kv, memtype, args)
    meta = ch.recv()
    remote_name = agent.add_remote_agent(meta["agent_metadata"])
    assert isinstance(remote_name, bytes)
    remote_blocks = [(base + b * meta["block_len"], meta["block_len"], meta["device_id"])
                     for base in meta["kv_caches_base_addr"] for b in range(meta["num_blocks"])]
    dst = agent.prep_xfer_dlist(remote_name, agent.get_xfer_descs(remote_blocks, memtype))
    n_regions = len(meta["kv_caches_base_addr"])

    errors, local_blocks = [], replay.pick_blocks(args.request_blocks, args.blocks, 6)
    recving = {}
    for _ in range(2):
        req = ch.recv()
        notif = f"{req['request']}:1".encode()
        if not req["remote_block_ids"]:
            agent.send_notif(remote_name, notif_msg=notif)
            continue
        lids = desc_ids(local_blocks, n_regions, args.blocks)
        rids = desc_ids(req["remote_block_ids"], n_regions, meta["num_blocks"])
        h = agent.make_prepped_xfer("READ", src, lids, dst, rids, notif_msg=notif)
        agent.transfer(h)
        recving[req["request"]] = h

    # get_finished on the consumer: poll each outstanding read once per step.
    deadline = time.monotonic() + TIMEOUT_S
    while recving and time.monotonic() < deadline:
        for rid, h in list(recving.items()):
            try:
                state = agent.check_xfer_state(h)
            except Exception as e:  # noqa: BLE001  (the connector marks the blocks invalid)
                errors.append(f"{rid}: {e}")
                agent.release_xfer_handle(h)
                del recving[rid]
                continue
            if state == "DONE":
                tel = agent.get_xfer_telemetry(h)
                want = 2 * args.layers * len(local_blocks) * args.block_bytes
                if tel.totalBytes != want or tel.xferDuration <= 0 or tel.postDuration < 0 \
                        or tel.descCount < 1 or tel.descCount > len(local_blocks) * n_regions:
                    errors.append(f"{rid}: telemetry {tel} (want {want} bytes)")
                agent.release_xfer_handle(h)
                del recving[rid]
            elif state != "PROC":
                errors.append(f"{rid}: state {state}")
                del recving[rid]
        time.sleep(STEP_S)
    if recving:
        errors.append(f"reads still running: {list(recving)}")
    errors += replay.check(kv, local_blocks, args.block_bytes)
    ch.send(errors)
    # Shutdown, in the connector's order.
    agent.release_dlist_handle(src)
    agent.release_dlist_handle(dst)
    agent.remove_remote_agent(remote_name)
    agent.deregister_memory(descs)
    for e in errors:
        print("decode:", e, file=sys.stderr)
    return not errors


if __name__ == "__main__":
    sys.exit(replay.main(prefill, decode))
