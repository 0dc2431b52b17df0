"""Fuzz live engines with sequences of well-formed messages (hypothesis), as a cluster member that lies
could send them: any message type on any socket (control or KV link), in any order, about requests that
exist or not, with token ids, lengths and KV that may not fit. Asserted afterwards: both engine processes
are the same live ones, they still serve a request correctly, and every KV block is free."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.control.errors import WireError
from pdserve.control.messages import (
    Abort,
    DescribeRequest,
    EngineStats,
    Error,
    GenerateRequest,
    PrefillRequest,
    Register,
    StatsRequest,
    TokenDelta,
)
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.sockets import ClientSocket
from pdserve.kvtransfer.messages import Hello, KVAck, KVDone, KVLayer, KVWant
from pdserve.local_cluster import Driver, EngineProcess
from tests.control.test_protocol import FINGERPRINT
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, start_at_free_kv_addresses, stop_together

pytestmark = pytest.mark.fuzz

REQUEST_IDS = ("a", "b", "c")
SHORT_TIMEOUTS = {"prefill": ("--kv-want-timeout", "1", "--kv-lease", "1"), "decode": ("--kv-timeout", "1", "--kv-queue-timeout", "1")}


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("peer-fuzz")
    trusted = [arg for address in DEAD_KV_ADDRESSES for arg in ("--kv-peer", address)]  # listed, but down
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", tiny_model_dir, *ENGINE_ARGS, *SHORT_TIMEOUTS["prefill"],
                                    "--kv-address", kv[0], log_dir=log_dir),
        lambda kv: EngineProcess("decode", tiny_model_dir, *ENGINE_ARGS, *SHORT_TIMEOUTS["decode"], "--kv-peer", kv[0],
                                 *trusted, log_dir=log_dir))
    yield prefill, decode
    stop_together(decode, prefill)


DEAD_KV_ADDRESSES = [f"tcp://127.0.0.1:{port}" for port in (1, 2, 3)]


@pytest.fixture(scope="module")
def tiny_model_dir(model_factory) -> str:
    return model_factory("llama")


def messages(kv_address: str):
    """One well-formed message of any type, about one of a few request ids."""
    ids = st.sampled_from(REQUEST_IDS)
    tokens = st.lists(st.integers(0, 1100), min_size=1, max_size=40)  # the tiny model's vocabulary is 1024
    sampling = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 1.0]), max_tokens=st.integers(1, 600),
                         logprobs=st.none() | st.integers(0, 3), seed=st.none() | st.integers(0, 9))
    address = st.sampled_from([kv_address, None, "tcp://127.0.0.1:1"])
    count = st.integers(0, 60)
    return st.one_of(
        st.builds(GenerateRequest, request_id=ids, prompt_token_ids=tokens, sampling_params=sampling,
                  prefill_kv_address=address),
        st.builds(PrefillRequest, request_id=ids, prompt_token_ids=tokens, sampling_params=sampling),
        st.builds(Abort, request_id=ids, reason=st.just("fuzz")),
        st.just(StatsRequest()), st.just(DescribeRequest()),
        st.builds(KVWant, request_id=ids, skip_tokens=count, num_tokens=st.integers(1, 60)),
        st.builds(KVAck, request_id=ids, ok=st.booleans()),
        st.builds(KVDone, request_id=ids, first_token=st.integers(0, 1100), num_tokens=st.integers(1, 60),
                  checksum=st.integers(0, 2**64 - 1)),
        st.builds(Hello, fingerprint=st.just(FINGERPRINT), role=st.sampled_from(["prefill", "decode"]),
                  engine_id=st.just("fuzz")),
        st.builds(TokenDelta, request_id=ids, token_ids=st.lists(st.integers(0, 9), max_size=3)),
        st.builds(Error, code=st.just("protocol_error"), message=st.just("fuzz"), request_id=st.none() | ids),
        st.just(EngineStats(engine_id="fuzz", role="decode", num_waiting=0, num_running=0, kv_blocks_used=0,
                            kv_blocks_total=1, queued_prefill_tokens=0)),
        st.just(Register(engine_id="fuzz", role="prefill", control_address="tcp://127.0.0.1:1", block_size=4,
                         max_model_len=64, vocab_size=1024)),
        st.builds(lambda request_id, layers, tokens: KVLayer.from_tensor(
            torch.zeros(layers, 2, tokens, 2, 8), request_id=request_id, layer_start=0,
            token_start=0), ids, st.integers(1, 3), st.integers(1, 8)),
    )


def send(socket: ClientSocket, msg) -> None:
    msg, *buffers = msg if isinstance(msg, tuple) else (msg,)
    try:
        socket.send(msg, *buffers, timeout=1.0)
    except WireError:
        pass  # a refused send is the engine's right (a full queue)


def test_any_sequence_of_messages_leaves_the_engines_serving_and_leak_free(engines):
    prefill, decode = engines
    sockets = {name: ClientSocket(address, linger=0) for name, address in
               (("prefill control", prefill.addresses["control"]), ("decode control", decode.addresses["control"]),
                ("prefill kv", prefill.addresses["kv"]))}

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(steps=st.lists(st.tuples(st.sampled_from(sorted(sockets)), messages(prefill.addresses["kv"]))
                          | st.floats(0.0, 0.3), min_size=1, max_size=8))
    def run(steps) -> None:
        for step in steps:
            if isinstance(step, float):  # a pause: let the engines act on what they got
                time.sleep(step)
            else:
                send(sockets[step[0]], step[1])
        for request_id in REQUEST_IDS:  # end what was started, as a router would on a client's disconnect
            send(sockets["prefill control"], Abort(request_id=request_id, reason="fuzz over"))
            send(sockets["decode control"], Abort(request_id=request_id, reason="fuzz over"))

    try:
        run()
    finally:
        for socket in sockets.values():
            socket.close()
    for engine in (prefill, decode):
        assert engine.process.poll() is None, f"the {engine.role} engine died:\n{engine.log()[-3000:]}"
    driver = Driver(decode, prefill)
    try:
        driver.wait_idle(timeout_s=10)  # what the fuzzing left is aborted or timed out
        results = driver.generate(PROMPTS[:2], prefix="after", **GREEDY)
        assert [r.finish_reason for r in results] == ["length", "length"], results
        decode_stats, prefill_stats = driver.wait_idle(timeout_s=10)
    finally:
        driver.close()
    assert decode_stats.kv_blocks_used == 0 and prefill_stats.kv_blocks_used == 0, (decode_stats, prefill_stats)
    assert decode_stats.num_running == decode_stats.num_waiting == decode_stats.num_waiting_for_remote_kv == 0


def test_a_request_naming_an_unreachable_prefill_engine_does_not_stall_decoding(engines):
    """Found by the fuzzing above: three GenerateRequests naming dead KV addresses held every other request for 6 s.
    The addresses are trusted (--kv-peer) here, so the decode engine does try them: without waiting."""
    _, decode = engines
    driver = Driver(decode)
    try:
        driver.generate(PROMPTS[:1], remote=False, prefix="warm", **GREEDY)
        for i, address in enumerate(DEAD_KV_ADDRESSES):
            driver.decode.send(GenerateRequest(request_id=f"dead-{i}", prompt_token_ids=PROMPTS[0],
                                               sampling_params=SamplingParams(**GREEDY), prefill_kv_address=address))
        started = time.monotonic()
        driver.submit("local", PROMPTS[1], remote=False, **GREEDY)
        while (received := driver.decode.recv(timeout=0.05)) is None or getattr(received.msg, "request_id", None) != "local" \
                or received.msg.finish_reason is None:
            assert time.monotonic() - started < 30
        elapsed = time.monotonic() - started
        failed_before = driver.decode_stats().num_kv_transfers_failed
        stats, _ = driver.wait_idle(timeout_s=10)
        deadline = time.monotonic() + 10
        while stats.num_kv_transfers_failed < failed_before + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = driver.decode_stats()
    finally:
        driver.close()
    assert elapsed < 1.0, f"a local request took {elapsed:.1f}s behind three requests naming dead prefill engines"
    assert stats.num_kv_transfers_failed >= 3, "the three were tried on their (dead) links and failed, then recomputed"
    assert stats.kv_blocks_used == 0 and stats.num_waiting_for_remote_kv == 0
