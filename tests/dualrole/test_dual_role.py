"""Dual-role engines (`pdserve engine`) between real processes over real ZeroMQ: each takes the prefill
role for one request and the decode role for another at the same time, or both for one (colocated), and
works beside the fixed-role engines. Greedy output equals the offline engine's token for token, and no
engine holds a KV block afterwards."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest

from pdserve.control.messages import GenerateRequest, PrefillRequest
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, assert_no_leaks, colocated_tokens
from tests.decode.test_disaggregated import start_together, stop_together


@dataclass
class Cluster:
    a: EngineProcess  # dual, streams its layers while a prompt computes
    b: EngineProcess  # dual, sends a prompt's KV once it is computed
    prefill: EngineProcess  # fixed role, trusted by A
    decode: EngineProcess  # fixed role, pulls from A


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def expected(model_dir):
    return colocated_tokens(model_dir, PROMPTS, **GREEDY)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """A and B trust each other's KV address (and A the fixed prefill engine's): known before any starts."""
    tmp = tmp_path_factory.mktemp("dual")
    kv = {name: f"ipc://{tmp}/{name}-kv.sock" for name in ("a", "b", "p")}
    def start(role: str, *args: str):
        return functools.partial(EngineProcess, role, model_dir, *ENGINE_ARGS, *args, log_dir=tmp)

    # all four at once (start_together): each one's KV peers are named by address, whenever they come up
    started = start_together(
        start("engine", "--engine-id", "dual-a", "--kv-address", kv["a"], "--kv-streaming", "on",
              "--kv-peer", kv["b"], "--kv-peer", kv["p"], "--kv-peer", kv["a"]),  # a router lists A's own too
        start("engine", "--engine-id", "dual-b", "--kv-address", kv["b"], "--kv-peer", kv["a"]),
        start("prefill", "--kv-address", kv["p"], "--kv-streaming", "on"),
        start("decode", "--kv-peer", kv["a"]))
    try:
        yield Cluster(*started)
    finally:
        stop_together(*started)


def submit_all(driver: Driver, prefix: str, prompts=PROMPTS, remote: bool = True) -> list[str]:
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        driver.submit(request_id, prompt, remote, **GREEDY)
    return ids


def tokens(driver: Driver, ids: list[str]) -> list[list[int]]:
    results = driver.collect(ids)
    assert all(results[i].finish_reason == "length" for i in ids), {i: results[i].error for i in ids}
    return [results[i].token_ids for i in ids]


def test_each_dual_engine_prefills_for_the_other_while_decoding_for_it(cluster, expected):
    """A prefills what B decodes while B prefills what A decodes: both roles at once on each engine."""
    a_to_b, b_to_a = Driver(cluster.b, cluster.a), Driver(cluster.a, cluster.b)
    try:
        before = a_to_b.prefill_stats(), a_to_b.decode_stats()
        ab_ids, ba_ids = submit_all(a_to_b, "ab"), submit_all(b_to_a, "ba")  # all ten in flight at once
        assert tokens(a_to_b, ab_ids) == expected
        assert tokens(b_to_a, ba_ids) == expected
        assert_no_leaks(a_to_b)
        assert_no_leaks(b_to_a)
        a, b = a_to_b.prefill_stats(), a_to_b.decode_stats()
        assert a.role == b.role == "dual"
        # each engine sent five prompts' KV and received five (the sum of both roles' transfers)
        assert (a.num_kv_transfers - before[0].num_kv_transfers,
                b.num_kv_transfers - before[1].num_kv_transfers) == (2 * len(PROMPTS),) * 2
        assert a.num_kv_transfers_failed == b.num_kv_transfers_failed == 0
        for engine, earlier in ((a, before[0]), (b, before[1])):  # and five of each as each role, apart
            prefill_side, decode_side = engine.kv_prefill_side, engine.kv_decode_side
            assert (prefill_side.num_kv_transfers - earlier.kv_prefill_side.num_kv_transfers,
                    decode_side.num_kv_transfers - earlier.kv_decode_side.num_kv_transfers) == (len(PROMPTS),) * 2
            assert prefill_side.kv_bytes_sent == engine.kv_bytes_sent and decode_side.kv_bytes_sent == 0
            assert decode_side.kv_bytes_received == engine.kv_bytes_received
        sent_by_a = a.kv_prefill_side.kv_bytes_sent - before[0].kv_prefill_side.kv_bytes_sent
        received_by_b = b.kv_decode_side.kv_bytes_received - before[1].kv_decode_side.kv_bytes_received
        assert sent_by_a > 0 and sent_by_a == received_by_b, "A prefilled for B alone"
    finally:
        a_to_b.close()
        b_to_a.close()


def test_a_dual_engine_colocates_a_request_that_names_no_peer(cluster, expected):
    driver = Driver(cluster.a)
    try:
        before = driver.decode_stats()
        assert tokens(driver, submit_all(driver, "local", remote=False)) == expected
        after = driver.decode_stats()
        assert after.num_kv_transfers == before.num_kv_transfers, "nothing crossed a KV link"
        assert after.kv_bytes_received == before.kv_bytes_received and after.kv_bytes_sent == before.kv_bytes_sent
        assert_no_leaks(driver)
    finally:
        driver.close()


def test_a_request_naming_the_engines_own_kv_address_is_colocated(cluster, expected):
    """The router picked A for both sides but named A's KV address: A computes the prompt itself rather
    than opening a link to itself."""
    driver = Driver(cluster.a)
    driver.prefill_kv = cluster.a.addresses["kv"]  # GenerateRequest(prefill_kv_address=A's), no PrefillRequest
    try:
        before = driver.decode_stats().num_kv_transfers, driver.decode_stats().num_kv_transfers_failed
        for i, prompt in enumerate(PROMPTS[:2]):
            driver.decode.send(GenerateRequest(request_id=f"self{i}", prompt_token_ids=prompt,
                                               sampling_params=SamplingParams(**GREEDY),
                                               prefill_kv_address=cluster.a.addresses["kv"]))
        assert tokens(driver, ["self0", "self1"]) == expected[:2]
        after = driver.decode_stats()
        assert (after.num_kv_transfers, after.num_kv_transfers_failed) == before, "no link to itself, no failure"
        assert_no_leaks(driver)
    finally:
        driver.close()


def test_dual_engines_work_beside_fixed_role_engines(cluster, expected):
    """A fixed decode engine pulls from dual A while dual A pulls from a fixed prefill engine."""
    to_fixed, from_fixed = Driver(cluster.decode, cluster.a), Driver(cluster.a, cluster.prefill)
    try:
        to_ids, from_ids = submit_all(to_fixed, "tofixed"), submit_all(from_fixed, "fromfixed")
        assert tokens(to_fixed, to_ids) == expected
        assert tokens(from_fixed, from_ids) == expected
        assert_no_leaks(to_fixed)
        assert_no_leaks(from_fixed)
        assert to_fixed.decode_stats().num_kv_transfers == len(PROMPTS), "the decode engine pulled every prompt"
        assert from_fixed.prefill_stats().num_kv_transfers == len(PROMPTS), "the prefill engine served every prompt"
    finally:
        to_fixed.close()
        from_fixed.close()


def test_a_dual_engine_never_pulls_from_an_untrusted_address(cluster, expected):
    """A request naming a KV address neither --kv-peer nor a router gave is prefilled locally, and the
    named address never hears from the engine (as for a decode engine)."""
    rogue = ServerSocket("ipc://" + str(cluster.a.log_path.parent / "rogue-kv.sock"))
    driver = Driver(cluster.a)
    try:
        before = driver.decode_stats()
        for i, prompt in enumerate(PROMPTS[:2]):
            driver.decode.send(GenerateRequest(request_id=f"forged{i}", prompt_token_ids=prompt,
                                               sampling_params=SamplingParams(**GREEDY), prefill_kv_address=rogue.address))
        assert tokens(driver, ["forged0", "forged1"]) == expected[:2]
        assert rogue.recv(timeout=1.0) is None, "the engine never connected to the named address"
        after = driver.decode_stats()
        assert after.num_kv_transfers == before.num_kv_transfers and after.kv_bytes_received == before.kv_bytes_received
        assert "neither registered with this engine's router nor was given with --kv-peer" in cluster.a.log()
        assert_no_leaks(driver)
    finally:
        driver.close()
        rogue.close()


def test_a_one_token_request_ends_on_the_dual_engine_that_prefills_it(cluster, expected):
    """max_tokens=1: the router sends only the PrefillRequest; its first token ends it there, and no KV
    is held for a decode engine that will never ask."""
    client = ClientSocket(cluster.a.addresses["control"])
    try:
        client.send(PrefillRequest(request_id="one", prompt_token_ids=PROMPTS[1],
                                   sampling_params=SamplingParams(**{**GREEDY, "max_tokens": 1})))
        deltas = []
        while not deltas or deltas[-1].finish_reason is None:
            received = client.recv(timeout=30.0)
            assert received is not None, "no answer from the dual engine"
            deltas.append(received.msg)
        assert [t for d in deltas for t in d.token_ids] == expected[1][:1]
        assert deltas[-1].finish_reason == "length"
        driver = Driver(cluster.a)
        try:
            assert_no_leaks(driver)
        finally:
            driver.close()
    finally:
        client.close()
