"""Prefill -> decode over real ZeroMQ sockets between real processes: output equals the colocated
engine token for token, KV bytes are exactly what the layout says, and no block leaks."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.local_cluster import Driver, EngineProcess

BLOCK = 4
ENGINE_ARGS = ("--block-size", str(BLOCK), "--num-kv-blocks", "256", "--max-num-batched-tokens", "32")
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
# one block, several blocks, a partial last block, a single token, a long prompt (chunked on P)
PROMPTS = [list(range(10, 14)), list(range(30, 46)), list(range(50, 61)), [7], list(range(100, 170))]


def colocated_llm(model_dir: str, dtype: str = "float32", device: str = "cpu") -> LLM:
    """The offline engine with the engines' KV layout: the reference for disaggregated output."""
    return LLM(model_dir, dtype=dtype, device=device, block_size=BLOCK, num_kv_blocks=256)


def colocated_outputs(llm: LLM, prompts, **sampling) -> list:  # one CompletionOutput per prompt
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampling))
    return [o.outputs[0] for o in outputs]


_COLOCATED_TOKENS: dict[str, list[list[int]]] = {}  # colocated_tokens' answers, by their arguments


def colocated_tokens(model_dir: str, prompts, device: str = "cpu", **sampling) -> list[list[int]]:
    """The colocated engine's tokens. Greedy or seeded, they are the same for the same arguments: those are computed
    once a session (many modules compare against the same prompts), an unseeded random draw every time."""
    key = json.dumps([model_dir, [list(p) for p in prompts], device, sampling], sort_keys=True)
    deterministic = sampling.get("temperature") == 0 or sampling.get("seed") is not None
    if not deterministic or key not in _COLOCATED_TOKENS:
        llm = colocated_llm(model_dir, device=device)
        _COLOCATED_TOKENS[key] = [o.token_ids for o in colocated_outputs(llm, prompts, **sampling)]
    return [list(tokens) for tokens in _COLOCATED_TOKENS[key]]


def free_kv_addresses(count: int) -> list[str]:
    """Loopback TCP addresses no socket holds now, for prefill engines' --kv-address: given before they start, their
    decode engines (which name them with --kv-peer) can start at the same time."""
    with contextlib.ExitStack() as stack:  # every probe held until all are bound: `count` different ports
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{probe.getsockname()[1]}" for probe in probes]


def start_together(*starts: Callable[[], EngineProcess]) -> list[EngineProcess]:
    """Engine processes started at once, each by its callable (each imports torch and loads its model: seconds of
    CPU, which the cores overlap), in the callables' order; if any does not start, the others are stopped and its
    error raised."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    started = [future.result() for future in futures if future.exception() is None]
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        stop_together(*started)
        raise failed[0]
    return started


def start_at_free_kv_addresses(count: int, *starts: Callable[[list[str]], EngineProcess]) -> list[EngineProcess]:
    """Each start(addresses) at once (start_together), given `count` free loopback KV addresses
    (free_kv_addresses); others if some other process bound one of them first."""
    for attempt in range(3):
        addresses = free_kv_addresses(count)
        try:
            return start_together(*(functools.partial(start, addresses) for start in starts))
        except RuntimeError as exc:
            if attempt == 2 or "Address already in use" not in str(exc):
                raise
    raise AssertionError("unreachable")


def stop_together(*processes: EngineProcess) -> None:
    """SIGTERM to every process at once, then each one's bounded wait (EngineProcess.stop)."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.stop()


def start_pair(model_dir: str, tmp_path, transport: str = "tcp", prefill_env=None, decode_args=(),
               prefill_args=("--kv-streaming", "on")):  # auto would not stream on CPU
    """A prefill engine and its decode engine, started at once."""
    if transport == "ipc":
        addresses = {name: f"ipc://{tmp_path}/{name}.sock" for name in ("p-control", "p-kv", "d-control")}
        p_args = ("--control-address", addresses["p-control"])
        d_args = ("--control-address", addresses["d-control"])
    else:
        p_args = d_args = ()

    def prefill(kv: list[str]) -> EngineProcess:
        return EngineProcess("prefill", model_dir, *ENGINE_ARGS, *p_args, "--kv-address", kv[0], *prefill_args,
                             env=prefill_env, log_dir=tmp_path)

    def decode(kv: list[str]) -> EngineProcess:
        return EngineProcess("decode", model_dir, *ENGINE_ARGS, *d_args, "--kv-peer", kv[0], *decode_args,
                             log_dir=tmp_path)

    if transport == "ipc":
        return tuple(start_together(lambda: prefill([addresses["p-kv"]]), lambda: decode([addresses["p-kv"]])))
    return tuple(start_at_free_kv_addresses(1, prefill, decode))


@contextlib.contextmanager
def running_pair(model_dir: str, tmp_path, **start_args) -> Iterator[Driver]:
    """A prefill + decode pair (start_pair) and a Driver for it, all stopped afterwards."""
    prefill, decode = start_pair(model_dir, tmp_path, **start_args)
    driver = Driver(decode, prefill)
    try:
        yield driver
    finally:
        driver.close()
        stop_together(prefill, decode)


def assert_no_leaks(driver: Driver) -> None:
    decode, prefill = driver.wait_idle()
    assert decode.kv_blocks_used == 0, f"decode engine leaked {decode.kv_blocks_used} blocks"
    assert prefill is None or prefill.kv_blocks_used == 0, f"prefill engine leaked {prefill.kv_blocks_used} blocks"
    assert decode.num_running == decode.num_waiting == decode.num_waiting_for_remote_kv == 0


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_disaggregated_equals_colocated(model_factory, tmp_path, arch, transport):
    model_dir = model_factory(arch)
    expected = colocated_tokens(model_dir, PROMPTS, **GREEDY)
    with running_pair(model_dir, tmp_path, transport=transport) as driver:
        results = driver.generate(PROMPTS, **GREEDY)  # all five in flight at once
        assert [r.token_ids for r in results] == expected
        assert all(r.finish_reason == "length" for r in results)
        stats = driver.decode_stats()
        assert stats.num_kv_transfers_failed == 0 and stats.kv_bytes_received > 0
        assert stats.num_kv_transfers == len(PROMPTS) and 0 < stats.kv_transfer_seconds < 60
        assert_no_leaks(driver)  # every ack has reached P by now
        sent = driver.prefill_stats()  # P times computed -> acked: the exposed part of each transfer
        assert sent.num_kv_transfers == len(PROMPTS) and 0 < sent.kv_transfer_seconds < 60


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("streaming", ["on", "off"])
def test_disaggregated_on_cuda_equals_colocated(model_factory, tmp_path, streaming):
    """On CUDA the streamed layers reach the host through asynchronous copies into pinned memory."""
    model_dir = model_factory("llama")
    expected = colocated_tokens(model_dir, PROMPTS, device="cuda", **GREEDY)
    cuda = ("--device", "cuda")
    with running_pair(model_dir, tmp_path, prefill_args=("--kv-streaming", streaming, *cuda),
                      decode_args=cuda) as driver:
        assert [r.token_ids for r in driver.generate(PROMPTS, **GREEDY)] == expected
        assert driver.decode_stats().num_kv_transfers_failed == 0
        assert_no_leaks(driver)


def test_kv_sent_after_the_prefill_equals_colocated(model_factory, tmp_path):
    """--kv-streaming off (the CPU default): the whole prompt's KV goes after it is computed."""
    model_dir = model_factory("llama")
    expected = colocated_tokens(model_dir, PROMPTS, **GREEDY)
    with running_pair(model_dir, tmp_path, prefill_args=("--kv-streaming", "off")) as driver:
        assert [r.token_ids for r in driver.generate(PROMPTS, **GREEDY)] == expected
        assert_no_leaks(driver)


def test_chunks_starting_mid_block_equal_colocated(model_factory, tmp_path):
    """P's step budget (30 tokens) is not a multiple of the block size (4), so streamed chunks start
    and end mid-block: D writes them token by token instead of whole blocks."""
    model_dir = model_factory("llama")
    prompts = [PROMPTS[4], list(range(300, 345))]  # 70 and 45 tokens
    expected = colocated_tokens(model_dir, prompts, **GREEDY)
    chunked = ("--kv-streaming", "on", "--max-num-batched-tokens", "30")
    with running_pair(model_dir, tmp_path, prefill_args=chunked) as driver:
        assert [r.token_ids for r in driver.generate(prompts, **GREEDY)] == expected
        assert driver.decode_stats().num_kv_transfers_failed == 0
        assert_no_leaks(driver)


def test_prefill_engine_with_a_tight_pool_serves_every_request(model_factory, tmp_path):
    """P's pool (26 blocks of 4) cannot hold all five prompts at once, and finished prompts keep their
    blocks until D acks: the long prompt waits for acks to free room. Every request arrives intact
    and nothing leaks."""
    model_dir = model_factory("llama")
    expected = colocated_tokens(model_dir, PROMPTS, **GREEDY)
    small_pool = ("--kv-streaming", "on", "--num-kv-blocks", "26")
    with running_pair(model_dir, tmp_path, prefill_args=small_pool) as driver:
        assert [r.token_ids for r in driver.generate(PROMPTS, **GREEDY)] == expected
        assert driver.decode_stats().num_kv_transfers_failed == 0
        assert driver.prefill_stats().kv_blocks_total == 26
        assert_no_leaks(driver)


def test_logprobs_of_the_first_token_come_from_the_prefill_engine(model_factory, tmp_path):
    """The first token is sampled on P and its logprobs travel in KVDone; the rest come from D. Both
    equal what the colocated engine reports."""
    model_dir = model_factory("llama")
    sampling = {**GREEDY, "logprobs": 2}
    outputs = colocated_outputs(colocated_llm(model_dir), PROMPTS[:3], **sampling)
    with running_pair(model_dir, tmp_path) as driver:
        results = driver.generate(PROMPTS[:3], **sampling)
        for result, expected in zip(results, outputs):
            assert result.token_ids == expected.token_ids
            assert len(result.logprobs) == len(expected.logprobs) == GREEDY["max_tokens"]
            for got, want in zip(result.logprobs, expected.logprobs):
                assert got.keys() == want.keys()
                for token_id in want:
                    assert got[token_id] == pytest.approx(want[token_id], abs=1e-4)
        assert_no_leaks(driver)


def test_bf16_kv_travels_as_two_bytes_per_value_and_equals_colocated(model_factory, tmp_path):
    """Engines in bfloat16: KV frames are bf16 bytes (no upcast on the wire), and a request decoded on
    D equals the colocated bf16 engine (one request at a time, so both run the same shapes)."""
    model_dir = model_factory("llama")
    bytes_per_token = 2 * 2 * 2 * 16 * 2  # K and V x layers x kv_heads x head_dim x bf16 bytes
    llm = colocated_llm(model_dir, dtype="bfloat16")
    bf16 = ("--dtype", "bfloat16")
    with running_pair(model_dir, tmp_path, prefill_args=("--kv-streaming", "on", *bf16), decode_args=bf16) as driver:
        for i, prompt in enumerate(PROMPTS[:3]):
            expected = colocated_outputs(llm, [prompt], **GREEDY)[0]
            assert driver.generate([prompt], prefix=f"bf16-{i}-", **GREEDY)[0].token_ids == expected.token_ids
        sent = sum(len(p) for p in PROMPTS[:3]) * bytes_per_token
        assert driver.prefill_stats().kv_bytes_sent == driver.decode_stats().kv_bytes_received == sent
        assert_no_leaks(driver)


def test_seeded_sampling_equals_colocated(model_factory, tmp_path):
    """The first token is sampled on P, the rest on D: a seed gives the colocated tokens anyway."""
    model_dir = model_factory("llama")
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 7, "max_tokens": 8, "ignore_eos": True}
    expected = colocated_tokens(model_dir, PROMPTS[:3], **sampling)
    with running_pair(model_dir, tmp_path) as driver:
        assert [r.token_ids for r in driver.generate(PROMPTS[:3], **sampling)] == expected
        assert_no_leaks(driver)


def test_decode_prefix_hit_sends_exactly_the_missing_tokens(model_factory, tmp_path):
    model_dir = model_factory("llama")
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv_heads x head_dim x fp32 bytes
    prefill, decode = start_pair(model_dir, tmp_path)
    driver = Driver(decode, prefill)
    try:
        first = list(range(200, 223))  # 23 tokens: 5 full blocks + 3
        driver.generate([first], prefix="first", **GREEDY)
        sent_before = driver.prefill_stats().kv_bytes_sent
        assert sent_before == 23 * bytes_per_token
        second = first[:20] + [9, 9, 9, 9, 9, 9]  # shares 5 blocks (20 tokens) with the first prompt
        results = driver.generate([second], prefix="second", **GREEDY)
        sent = driver.prefill_stats().kv_bytes_sent - sent_before
        assert sent == (26 - 20) * bytes_per_token, "only tokens after D's prefix hit may travel"
        assert results[0].token_ids == colocated_tokens(model_dir, [second], **GREEDY)[0]
        decode_stats, prefill_stats = driver.decode_stats(), driver.prefill_stats()
        assert decode_stats.kv_bytes_received == prefill_stats.kv_bytes_sent
        # both engines reused the 5 shared blocks from their own prefix caches (P computed 6 tokens)
        assert (decode_stats.prefix_cache_queries, decode_stats.prefix_cache_hits) == (23 + 26, 20)
        assert (prefill_stats.prefix_cache_queries, prefill_stats.prefix_cache_hits) == (23 + 26, 20)
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(prefill, decode)


@pytest.mark.parametrize("streaming", ["on", "off"])
def test_prefill_prefix_hit_serves_a_decode_engine_without_it(model_factory, tmp_path, streaming):
    """Two decode engines share one prefill engine. A prefix prefilled for D1 is in P's prefix cache
    but not in D2's: for D2, P sends those tokens from its cache and computes only the rest."""
    model_dir = model_factory("llama")
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv_heads x head_dim x fp32 bytes
    prefill, first_decode, second_decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], "--kv-streaming",
                                    streaming, log_dir=tmp_path),
        *[lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv[0], log_dir=tmp_path)] * 2)
    first_driver, second_driver = Driver(first_decode, prefill), Driver(second_decode, prefill)
    try:
        shared = list(range(200, 220))  # 5 full blocks
        first_driver.generate([shared + [1, 2, 3]], prefix="first", **GREEDY)
        prompt = shared + [9, 9, 9, 9, 9, 9]
        result = second_driver.generate([prompt], prefix="second", **GREEDY)[0]
        assert result.token_ids == colocated_tokens(model_dir, [prompt], **GREEDY)[0]
        decode_stats, prefill_stats = second_driver.decode_stats(), second_driver.prefill_stats()
        assert decode_stats.prefix_cache_hits == 0 and decode_stats.kv_bytes_received == 26 * bytes_per_token
        assert prefill_stats.prefix_cache_hits == 20, "P computed only the 6 new tokens"
        assert decode_stats.num_kv_transfers_failed == 0
        assert_no_leaks(first_driver)
        assert_no_leaks(second_driver)
    finally:
        for driver in (first_driver, second_driver):
            driver.close()
        stop_together(prefill, first_decode, second_decode)


def test_one_decode_engine_pulls_from_two_prefill_engines(model_factory, tmp_path):
    """2P1D: requests alternate between a streaming and a send-after prefill engine; the decode engine
    keeps one KV link per prefill engine, all in flight at once."""
    model_dir = model_factory("llama")
    expected = colocated_tokens(model_dir, PROMPTS, **GREEDY)
    streamed, after, decode = start_at_free_kv_addresses(
        2, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], "--kv-streaming", "on",
                                    log_dir=tmp_path),
        lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[1], "--kv-streaming", "off",
                                 "--engine-id", "prefill-1", log_dir=tmp_path),
        lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv[0], "--kv-peer", kv[1],
                                 log_dir=tmp_path))
    drivers = [Driver(decode, streamed), Driver(decode, after)]
    try:
        for i, prompt in enumerate(PROMPTS):
            drivers[i % 2].submit(f"r{i}", prompt, **GREEDY)
        results = {}
        for k, driver in enumerate(drivers):
            results.update(driver.collect([f"r{i}" for i in range(len(PROMPTS)) if i % 2 == k]))
        assert [results[f"r{i}"].token_ids for i in range(len(PROMPTS))] == expected
        stats = drivers[0].decode_stats()
        assert stats.num_kv_transfers == len(PROMPTS) and stats.num_kv_transfers_failed == 0
        assert [driver.prefill_stats().num_kv_transfers for driver in drivers] == [3, 2]
        for driver in drivers:
            assert_no_leaks(driver)
    finally:
        for driver in drivers:
            driver.close()
        stop_together(streamed, after, decode)
