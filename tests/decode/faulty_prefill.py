"""A prefill engine whose KV link misbehaves for real, for the fault tests:

    python -m tests.decode.faulty_prefill prefill --model DIR ... --fault drop:0[,corrupt:3,...]

It wraps `KVSender.send_layer`, which every KVLayer message passes through, then runs the normal entry
point. `action:N` acts on the N-th KVLayer message the engine sends: drop (never sent), corrupt (one
payload byte flipped), delay (sent 2 s late) or stall (the engine hangs inside the send for good).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time

from pdserve.cli import main
from pdserve.prefill.kv_sender import KVSender

log = logging.getLogger("tests.faulty_prefill")
ACTIONS = ("drop", "corrupt", "stall", "delay")


def parse_faults(spec: str) -> dict[int, str]:
    """"drop:3,corrupt:5" -> {3: "drop", 5: "corrupt"}."""
    faults = {}
    for item in filter(None, spec.split(",")):
        action, _, index = item.partition(":")
        if action not in ACTIONS or not index.isdigit():
            raise ValueError(f"--fault {spec!r}: use comma-separated drop:N, corrupt:N, stall:N or delay:N")
        faults[int(index)] = action
    return faults


def inject(faults: dict[int, str]) -> None:
    send_layer = KVSender.send_layer
    message_index = itertools.count()

    def faulty_send_layer(self, peer_id, msg, payload):
        action = faults.get(next(message_index))
        if action == "drop":
            return
        if action == "corrupt":
            payload = bytearray(payload)
            payload[len(payload) // 2] ^= 0x40
        elif action == "delay":
            log.error("fault injection: delaying a KV send by 2 s")
            time.sleep(2.0)
        elif action == "stall":
            log.error("fault injection: stalling forever mid-transfer")
            while True:
                time.sleep(3600)
        send_layer(self, peer_id, msg, payload)

    KVSender.send_layer = faulty_send_layer


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = argv.index("--fault")
    inject(parse_faults(argv[at + 1]))
    sys.exit(main(argv[:at] + argv[at + 2:]))
