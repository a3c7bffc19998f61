# SPDX-License-Identifier: Apache-2.0
"""A target engine in its own OS process, driven over stdin/stdout (one line each way).

Prints "READY <engine desc hex> <memory desc hex>", then answers:
  register <hex>          register the initiator's engine          -> OK
  fill <seed> / zero      fill the region                          -> OK
  sha <off> <len>         sha256 of a range of the region          -> SHA <hex>
  pop <key> <uid> <ms>    wait for an inbound status               -> LANDED <code> | NONE
  notifs <ms>             drain the inbox, waiting for the first   -> NOTIFS <key>:<hex> ...
  send <key> <hex>        a notification message to that engine    -> SENT <code>
  quit                                                             -> exits 0
Usage: peer.py <key> <backend> <region bytes> <timeout ms>
"""
import hashlib
import sys

import numpy as np

import ferry
from conftest import pattern


def main():
    key, backend, size, timeout_ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    eng = ferry.IOEngine(key, ferry.IOEngineConfig(port=0, timeout_ms=timeout_ms))
    eng.create_backend(backend)
    region = np.zeros(size, dtype=np.uint8)
    mem = eng.register_buffer(region)
    print("READY", eng.get_engine_desc().pack().hex(), mem.pack().hex(), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "register":
            eng.register_remote_engine(ferry.EngineDesc.unpack(bytes.fromhex(cmd[1])))
            out = "OK"
        elif cmd[0] == "fill":
            region[:] = pattern(size, int(cmd[1]))
            out = "OK"
        elif cmd[0] == "zero":
            region[:] = 0
            out = "OK"
        elif cmd[0] == "sha":
            off, n = int(cmd[1]), int(cmd[2])
            out = "SHA " + hashlib.sha256(region[off:off + n].tobytes()).hexdigest()
        elif cmd[0] == "pop":
            st = eng.wait_inbound(cmd[1], int(cmd[2]), timeout_ms=int(cmd[3]))
            out = "NONE" if st is None else f"LANDED {st.Code().name}"
        elif cmd[0] == "notifs":
            got = eng.wait_notifications(timeout_ms=int(cmd[1]))
            out = " ".join(["NOTIFS"] + [f"{k}:{m.hex()}" for k, ms in got.items() for m in ms])
        elif cmd[0] == "send":
            st = eng.send_notification(cmd[1], bytes.fromhex(cmd[2]) if len(cmd) > 2 else b"")
            st.Wait()
            out = f"SENT {st.Code().name}"
        elif cmd[0] == "quit":
            break
        else:
            out = "ERR unknown command"
        print(out, flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
