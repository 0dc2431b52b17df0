"""A prefill engine whose KV link misbehaves for real, for the fault tests:

    python -m tests.decode.faulty_prefill prefill --model DIR ... --fault drop:0[,corrupt:3,...]

It wraps `KVSender.send_layer`, which every KVLayer message passes through, then runs the normal entry
point. `action:N` acts on the N-th KVLayer message the engine sends: drop (never sent), corrupt (one
payload byte flipped), delay (sent 2 s late; `delay:N:S` for S seconds) or stall (the engine hangs inside the
send for good).
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


DEFAULT_DELAY_S = 2.0


def parse_faults(spec: str) -> dict[int, tuple[str, float]]:
    """"drop:3,delay:5:4" -> {3: ("drop", 2.0), 5: ("delay", 4.0)}: (action, seconds of a delay)."""
    faults = {}
    for item in filter(None, spec.split(",")):
        action, _, rest = item.partition(":")
        index, _, seconds = rest.partition(":")
        if (action not in ACTIONS or not index.isdigit()
                or (seconds and (action != "delay" or not seconds.replace(".", "", 1).isdigit()))):
            raise ValueError(f"--fault {spec!r}: use comma-separated drop:N, corrupt:N, stall:N or delay:N[:SECONDS]")
        faults[int(index)] = (action, float(seconds or DEFAULT_DELAY_S))
    return faults


def inject(faults: dict[int, str]) -> None:
    send_layer = KVSender.send_layer
    message_index = itertools.count()

    def faulty_send_layer(self, peer_id, msg, payload):
        action, delay_s = faults.get(next(message_index), (None, 0.0))
        if action == "drop":
            return
        if action == "corrupt":
            payload = bytearray(payload)
            payload[len(payload) // 2] ^= 0x40
        elif action == "delay":
            log.error("fault injection: delaying a KV send by %g s", delay_s)
            time.sleep(delay_s)
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
