"""Peers cannot stall an engine's loop: one that floods its control socket with requests and never reads
the replies, or one that sends an oversized frame, costs the engine at most dropped replies."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.control.errors import WireError
from pdserve.control.messages import StatsRequest
from pdserve.control.sockets import ClientSocket
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS

FLOOD_S = 6.0


def _flood(address: str, stop: threading.Event) -> int:
    """StatsRequests as fast as the socket takes them, never reading a reply; how many went out."""
    sent = 0
    with ClientSocket(address, send_timeout=0.05, linger=0) as flooder:
        while not stop.is_set():
            try:
                flooder.send(StatsRequest())
                sent += 1
            except WireError:
                pass
    return sent


@pytest.fixture
def decode_engine(model_factory, tmp_path):
    engine = EngineProcess("decode", model_factory("llama"), *ENGINE_ARGS, log_dir=tmp_path)
    yield engine
    engine.stop()


def test_a_stats_flood_that_never_reads_does_not_stall_decoding(decode_engine):
    driver = Driver(decode_engine)
    try:
        expected = [r.token_ids for r in driver.generate(PROMPTS[:2], remote=False, **GREEDY)]
        stop, counts = threading.Event(), []
        flooder = threading.Thread(target=lambda: counts.append(_flood(decode_engine.addresses["control"], stop)))
        flooder.start()
        try:
            time.sleep(1.0)  # the flooder's reply queue is full long before this
            started = time.monotonic()
            results = driver.generate(PROMPTS[:2], remote=False, prefix="during", **GREEDY)
            elapsed = time.monotonic() - started
        finally:
            stop.set()
            flooder.join()
        assert [r.token_ids for r in results] == expected
        assert counts[0] > 10_000, "the flood really ran"
        assert elapsed < FLOOD_S, f"decoding took {elapsed:.1f}s under the flood: the loop was stalled"
        assert driver.decode_stats().kv_blocks_used == 0
    finally:
        driver.close()


def test_an_oversized_control_frame_is_refused_and_the_engine_keeps_serving(decode_engine):
    import zmq

    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.connect(decode_engine.addresses["control"])
    try:
        rogue.send(b"x" * (4 << 20))  # 4 MiB: no control message is that large; the peer is dropped unread
        assert not rogue.poll(1000), "dropped at the socket, not read, decoded and answered"
        driver = Driver(decode_engine)
        try:
            assert [r.finish_reason for r in driver.generate(PROMPTS[:1], remote=False, **GREEDY)] == ["length"]
        finally:
            driver.close()
    finally:
        rogue.close(linger=0)
        context.term()
    assert decode_engine.process.poll() is None, "the engine is still running"
