"""The KV link's timed part holds the sends and the receiver's ack only: making the payload is not
timed (a slow first torch op once put ~5 ms per request into the CPU profile's link intercept)."""

import queue
import threading
import time

from pdserve.planner.profile import kv_link as connector_throughput

SLOW_S = 0.5


def test_the_payload_is_made_before_the_clock_starts(monkeypatch):
    make = connector_throughput.random_kv

    def slow_random_kv(message_bytes):
        time.sleep(SLOW_S)
        return make(message_bytes)

    monkeypatch.setattr(connector_throughput, "random_kv", slow_random_kv)
    scenarios = [("tcp", mode, 1, 1, 2, "tcp://127.0.0.1:0") for mode in ("kv", "raw")]
    addresses, results = queue.Queue(), queue.Queue()
    sides = [threading.Thread(target=connector_throughput.run_sender, args=(scenarios, addresses, results, None, None)),
             threading.Thread(target=connector_throughput.run_receiver, args=(scenarios, addresses, results, None, None))]
    for side in sides:
        side.start()
    for side in sides:
        side.join(30)
    sent = {index: seconds for role, index, seconds, *_ in (results.get_nowait() for _ in range(results.qsize()))
            if role == "send"}
    assert sorted(sent) == [0, 1]
    assert all(seconds < SLOW_S for seconds in sent.values()), sent
