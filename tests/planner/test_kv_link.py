"""The KV link's timed part holds the sends and the receiver's ack only: making the payload is not
timed (a slow first torch op once put ~5 ms per request into the CPU profile's link intercept)."""

import queue
import threading
import time

from pdserve.planner.profile import kv_link

SLOW_S = 0.5


def run_link(monkeypatch, scenarios: list[tuple], send=None, receive=None) -> dict[int, float]:
    """Each scenario's timed seconds, its payload made SLOW_S slower than it is; sender and receiver threads."""
    make = kv_link.random_kv

    def slow_random_kv(message_bytes):
        time.sleep(SLOW_S)
        return make(message_bytes)

    monkeypatch.setattr(kv_link, "random_kv", slow_random_kv)
    addresses, results = queue.Queue(), queue.Queue()
    sides = [threading.Thread(target=kv_link.run_sender, args=(scenarios, addresses, results, None, None, send)),
             threading.Thread(target=kv_link.run_receiver, args=(scenarios, addresses, results, None, None, receive))]
    for side in sides:
        side.start()
    for side in sides:
        side.join(30)
    return {index: seconds for role, index, seconds, *_ in (results.get_nowait() for _ in range(results.qsize()))
            if role == "send"}


def test_the_payload_is_made_before_the_clock_starts(monkeypatch):
    sent = run_link(monkeypatch, [("tcp", "kv", 1, 1, 2, "tcp://127.0.0.1:0")] * 2)
    assert sorted(sent) == [0, 1]
    assert all(seconds < SLOW_S for seconds in sent.values()), sent
