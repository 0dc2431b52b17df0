"""The KV link carries what the decode engine needs of sliding-window layers, and no more (Mistral: every layer
slides; Gemma 2 and gpt-oss 1:1, Gemma 3 5:1 sliding : full): prefill and decode
processes over real ZeroMQ, greedy fp32 output equal to transformers, the bytes of every request exactly
what the layout says (a sliding layer: the blocks its window reaches from the first decoded token; a full
layer: every token), no block left behind, and a pair whose per-layer windows differ refused with a
sentence that names the layers. Hybrid models keep a block table per layer group on both engines: the decode
engine holds a sliding group's window only (its peak for a long generation is below one table's), and a failed
transfer, an abort mid-transfer and a preemption free every group's blocks."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.peak_blocks_engine import peak_in_log
from tests.decode.test_disaggregated import (
    BLOCK,
    ENGINE_ARGS,
    assert_no_leaks,
    running_pair,
    start_at_free_kv_addresses,
    start_pair,
    stop_together,
)
from tests.decode.test_faults import wait_for_log
from tests.engine.parity import assert_greedy_match, hf_greedy
from tests.engine.test_transformers_backend import make_hf_model_dir

WINDOW = 8
KV_HEADS, HEAD_DIM, FP32 = 2, 16, 4
LAYER_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * FP32  # K and V of one layer and one token
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
# 4x the window (block aligned), 4x plus a partial block, about 6x: each several windows long
PROMPTS = [list(range(10, 10 + 4 * WINDOW)), list(range(60, 60 + 4 * WINDOW + 3)), list(range(200, 250))]
# Each model's layers: its sliding window, or None for full attention.
LAYER_WINDOWS = {
    "mistral": [WINDOW, WINDOW],
    "gemma2": [WINDOW, None],  # alternating, with attention and final logit soft caps
    "gemma3": [WINDOW] * 5 + [None],
    "gpt-oss": [WINDOW, None],  # alternating, with attention sinks; experts through transformers' own code
}
HF_MODELS = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0,
                                                     "query_pre_attn_scalar": 24}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_hidden_layers": 6, "query_pre_attn_scalar": 24}),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.fixture(scope="module")
def window_model_dir(model_factory, tmp_path_factory):
    built: dict[str, str] = {}

    def make(case: str) -> str:
        if case not in built:
            if case == "mistral":
                built[case] = model_factory("mistral", sliding_window=WINDOW)
            else:
                config_class, architecture, fields = HF_MODELS[case]
                fields = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS, "sliding_window": WINDOW, **fields}
                built[case] = make_hf_model_dir(tmp_path_factory.mktemp(f"hf-{case}"), config_class, architecture,
                                                model_factory("llama"), **fields)
        return built[case]

    return make


@pytest.fixture(scope="module")
def hf_reference(window_model_dir):
    """hf_reference(case): transformers' model of window_model_dir(case), loaded once a module (generate() leaves it
    as it was)."""
    loaded: dict[str, torch.nn.Module] = {}

    def load(case: str) -> torch.nn.Module:
        if case not in loaded:
            loaded[case] = AutoModelForCausalLM.from_pretrained(window_model_dir(case), dtype=torch.float32).eval()
        return loaded[case]

    return load


@pytest.fixture(scope="module")
def window_pair(window_model_dir, tmp_path_factory):
    """window_pair(case): a Driver for a prefill engine that streams KV and a decode engine that logs its peak
    (tests/decode/peak_blocks_engine.py) on window_model_dir(case), started once a module for the tests that run
    such a pair. Each of them sends prompts no other sends (no prefix hit on another's blocks), reads counters as
    differences, and ends with no block held (assert_no_leaks)."""
    drivers: dict[str, Driver] = {}

    def get(case: str) -> Driver:
        if case not in drivers:
            model_dir, log_dir = window_model_dir(case), tmp_path_factory.mktemp(f"pair-{case}")
            prefill, decode = start_at_free_kv_addresses(
                1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0],
                                            "--kv-streaming", "on", log_dir=log_dir),
                lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv[0], log_dir=log_dir,
                                         module="tests.decode.peak_blocks_engine"))
            drivers[case] = Driver(decode, prefill)
        return drivers[case]

    yield get
    for driver in drivers.values():
        driver.close()
        stop_together(*driver.engines)


def expected_bytes(prompt_len: int, windows: list[int | None]) -> int:
    """A sliding layer sends the tokens from the first block that the first decoded token's window (at position
    prompt_len) reaches; a full layer sends every token."""
    first_in_window = max(0, prompt_len - WINDOW + 1) // BLOCK * BLOCK
    tokens = sum(prompt_len if window is None else prompt_len - first_in_window for window in windows)
    return tokens * LAYER_TOKEN_BYTES


def full_kv_bytes(prompt_len: int, windows: list[int | None]) -> int:
    return len(windows) * prompt_len * LAYER_TOKEN_BYTES


@pytest.mark.parametrize("case, streaming", [("mistral", "on"), ("mistral", "off"), ("gemma2", "on"),
                                             ("gemma3", "on"), ("gpt-oss", "off")])
def test_only_the_window_travels_and_output_equals_transformers(window_model_dir, hf_reference, window_pair, case,
                                                               streaming, tmp_path):
    model_dir = window_model_dir(case)
    windows = LAYER_WINDOWS[case]
    reference = hf_reference(case)
    # streaming on: the module's pair for this model (window_pair); off: a pair of its own
    pair = contextlib.nullcontext(window_pair(case)) if streaming == "on" else \
        running_pair(model_dir, tmp_path, prefill_args=("--kv-streaming", streaming))
    with pair as driver:
        decode_before = driver.decode_stats()
        sent_at_start = sent_before = driver.prefill_stats().kv_bytes_sent
        for i, prompt in enumerate(PROMPTS):  # one at a time: each request's bytes on their own
            result = driver.generate([prompt], prefix=f"{case}-{i}-", **GREEDY)[0]
            theirs, logits = hf_greedy(reference, prompt, GREEDY["max_tokens"])
            assert_greedy_match(result.token_ids, theirs, logits, f"{case} 1P1D prompt of {len(prompt)}")
            sent = driver.prefill_stats().kv_bytes_sent - sent_before
            assert sent == expected_bytes(len(prompt), windows), f"prompt of {len(prompt)} tokens"
            assert sent < full_kv_bytes(len(prompt), windows)
            sent_before += sent
        decode_stats = driver.decode_stats()
        assert decode_stats.kv_bytes_received - decode_before.kv_bytes_received == sent_before - sent_at_start
        assert decode_stats.num_kv_transfers - decode_before.num_kv_transfers == len(PROMPTS)
        assert decode_stats.num_kv_transfers_failed == 0
        assert_no_leaks(driver)


def test_decode_prefix_hits_use_only_blocks_that_hold_every_layers_kv(hf_reference, window_pair):
    """D publishes a received prompt's blocks from its window's first block on: the blocks before hold no sliding
    KV. A prompt that shares only those blocks gets no hit; one that shares the window's blocks gets them, and P
    sends only the rest."""
    windows = LAYER_WINDOWS["mistral"]
    reference = hf_reference("mistral")
    first = list(range(300, 336))  # 36 tokens: the window of position 36 starts at token 28 (block 7)
    shares_unpublished = first[:32] + [9] * 8  # would need blocks 6 and 7 for a hit of 32: 6 is unpublished
    shares_window = first + [5, 6, 7, 8, 9]  # hit of 36 tokens: the window of position 36 needs blocks 7, 8
    driver = window_pair("mistral")
    hits_before = driver.decode_stats().prefix_cache_hits
    sent_before = driver.prefill_stats().kv_bytes_sent
    for name, prompt, hit in (("first", first, 0), ("unpublished", shares_unpublished, 0),
                              ("window", shares_window, 36)):
        result = driver.generate([prompt], prefix=f"{name}-", **GREEDY)[0]
        theirs, logits = hf_greedy(reference, prompt, GREEDY["max_tokens"])
        assert_greedy_match(result.token_ids, theirs, logits, f"mistral 1P1D, {name} prompt")
        sent = driver.prefill_stats().kv_bytes_sent - sent_before
        expected = expected_bytes(len(prompt), windows) if hit == 0 else \
            len(windows) * (len(prompt) - hit) * LAYER_TOKEN_BYTES
        assert sent == expected, f"{name} prompt"
        sent_before += sent
    assert driver.decode_stats().prefix_cache_hits - hits_before == 36
    assert_no_leaks(driver)


def test_a_pair_whose_layer_windows_differ_is_refused_naming_the_layers(window_model_dir, tmp_path):
    """The same weights with another window in config.json: P refuses D's link, naming each differing layer;
    D computes the prompt itself, and nothing leaks on either side."""
    model_dir = window_model_dir("mistral")
    other = tmp_path / "mistral-window-16"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "sliding_window": 2 * WINDOW}))
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], log_dir=tmp_path),
        lambda kv: EngineProcess("decode", str(other), *ENGINE_ARGS, "--kv-peer", kv[0], log_dir=tmp_path))
    driver = Driver(decode, prefill)
    try:
        result = driver.generate([PROMPTS[0]], prefix="mismatch-", **GREEDY)[0]
        assert len(result.token_ids) == GREEDY["max_tokens"]
        assert driver.decode_stats().num_kv_transfers_failed == 1
        assert driver.prefill_stats().kv_bytes_sent == 0
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(prefill, decode)
    sentence = "layer_windows differ at layers 0, 1: local 0=8 1=8, remote 0=16 1=16"
    log = decode.log_path.read_text()
    assert sentence in log, f"the decode engine's log does not say {sentence!r}"


LONG = {"temperature": 0.0, "max_tokens": 60, "ignore_eos": True}  # decoding runs seven windows past the prompt
# prompts of PROMPTS[1]'s length (4x the window plus a partial block) that no other test sends to window_pair's engines
LONG_PROMPT, FIRST_TURN = list(range(400, 400 + 4 * WINDOW + 3)), list(range(500, 500 + 4 * WINDOW + 3))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "gpt-oss"])
def test_decode_frees_sliding_blocks_of_a_long_generation(hf_reference, window_pair, case):
    """D (logging its peak, tests/decode/peak_blocks_engine.py) receives a prompt of four windows and decodes 60
    tokens: a sliding group holds at most the blocks its window reaches, so D's peak is below what one block
    table for every layer holds (every block of every layer), with transformers' tokens and no block left. D's
    peak is the most it held for any request of window_pair's, each shorter than this one."""
    windows = LAYER_WINDOWS[case]
    prompt = LONG_PROMPT
    reference = hf_reference(case)
    driver = window_pair(case)
    decode = driver.engines[0]
    sent_before = driver.prefill_stats().kv_bytes_sent
    result = driver.generate([prompt], prefix=f"{case}-long-", **LONG)[0]
    theirs, logits = hf_greedy(reference, prompt, LONG["max_tokens"])
    assert_greedy_match(result.token_ids, theirs, logits, f"{case} 1P1D, a long generation")
    assert driver.prefill_stats().kv_bytes_sent - sent_before == expected_bytes(len(prompt), windows)
    assert_no_leaks(driver)
    num_blocks = _cdiv(len(prompt) + LONG["max_tokens"] - 1, BLOCK)  # the last token's KV is never computed
    one_table = len(windows) * num_blocks  # layer-blocks: one layer's K and V of BLOCK tokens
    window_blocks = _cdiv(WINDOW - 1, BLOCK) + 1  # the most blocks the window (p - W, p] touches
    per_group = sum(num_blocks if window is None else window_blocks for window in windows)
    peak = peak_in_log(decode.log())
    assert 0 < peak <= per_group < one_table, f"D held {peak} layer-blocks at once; one table holds {one_table}"


def _kv_link_pair(model_dir: str, tmp_path, fault: str) -> tuple[EngineProcess, EngineProcess]:
    """P misbehaving on its KV link as `fault` says (tests/decode/faulty_prefill.py), and its D."""
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], "--kv-streaming", "on",
                                    "--fault", fault, log_dir=tmp_path, module="tests.decode.faulty_prefill"),
        lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv[0], "--kv-timeout", "4",
                                 "--kv-queue-timeout", "4", log_dir=tmp_path))
    return prefill, decode


def test_an_abort_mid_transfer_and_corrupt_kv_free_every_group_of_a_hybrid_model(window_model_dir, hf_reference,
                                                                                  tmp_path):
    """Gemma 3 (six layer groups): a request aborted while P's first KV send is delayed ends with no block held on
    either engine; then corrupt KVLayers fail a transfer, and D frees every group's blocks and computes the
    prompt itself (transformers' tokens)."""
    model_dir = window_model_dir("gemma3")
    reference = hf_reference("gemma3")
    # the aborted request (one chunk) sends at most a message per layer: whichever come next, some are corrupt
    fault = ",".join(["delay:0", *(f"corrupt:{index}" for index in range(1, 16))])
    prefill, decode = _kv_link_pair(model_dir, tmp_path, fault)
    driver = Driver(decode, prefill)
    try:
        driver.submit("slow", PROMPTS[0], **GREEDY)
        wait_for_log(prefill, "delaying a KV send")  # P is inside the delayed send; D waits for the KV
        assert driver.decode_stats().num_waiting_for_remote_kv == 1
        driver.abort("slow")
        assert driver.collect(["slow"], timeout_s=15)["slow"].finish_reason == "abort"
        assert_no_leaks(driver)
        failed_before = driver.decode_stats().num_kv_transfers_failed
        result = driver.generate([PROMPTS[1]], prefix="corrupt-", **GREEDY)[0]
        theirs, logits = hf_greedy(reference, PROMPTS[1], GREEDY["max_tokens"])
        assert_greedy_match(result.token_ids, theirs, logits, "gemma3 1P1D, recomputed after corrupt KV")
        assert driver.decode_stats().num_kv_transfers_failed == failed_before + 1
        assert "checksum" in decode.log()
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(prefill, decode)


def test_preempted_hybrid_requests_on_decode_keep_parity_and_free_every_group(window_model_dir, hf_reference,
                                                                              tmp_path):
    """Gemma 3 with a decode pool that three long generations overflow: D preempts (freeing every group's blocks)
    and recomputes locally; every request still gives transformers' tokens and nothing leaks."""
    model_dir = window_model_dir("gemma3")
    reference = hf_reference("gemma3")
    prefill, decode = start_pair(model_dir, tmp_path, decode_args=("--num-kv-blocks", "90"))
    driver = Driver(decode, prefill)
    try:
        results = driver.generate(PROMPTS, prefix="preempt-", **LONG)
        for prompt, result in zip(PROMPTS, results):
            theirs, logits = hf_greedy(reference, prompt, LONG["max_tokens"])
            assert_greedy_match(result.token_ids, theirs, logits, f"gemma3 1P1D under preemption, prompt of "
                                                                   f"{len(prompt)}")
        stats = driver.decode_stats()
        assert stats.num_preemptions > 0 and stats.num_kv_transfers == len(PROMPTS)
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(prefill, decode)


def test_a_hybrid_decode_engine_reuses_its_own_decoded_blocks_as_prefix_hits(hf_reference, window_pair):
    """Gemma 3, a second turn: the prompt is the first prompt, its answer and a few new tokens. D's hit covers every
    block it computed or received whose window blocks every group still has cached (decoded blocks that left a
    sliding window stay cached), P sends only the tokens after it, and both turns give transformers' tokens."""
    windows = LAYER_WINDOWS["gemma3"]
    reference = hf_reference("gemma3")
    first_turn = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}
    driver = window_pair("gemma3")
    hits_before = driver.decode_stats().prefix_cache_hits
    first = FIRST_TURN
    answer = driver.generate([first], prefix="turn1-", **first_turn)[0].token_ids
    theirs, logits = hf_greedy(reference, first, first_turn["max_tokens"])
    assert_greedy_match(answer, theirs, logits, "gemma3 1P1D, first turn")
    sent_before = driver.prefill_stats().kv_bytes_sent
    second = first + answer + [5, 6, 7, 8, 9]
    result = driver.generate([second], prefix="turn2-", **GREEDY)[0]
    theirs, logits = hf_greedy(reference, second, GREEDY["max_tokens"])
    assert_greedy_match(result.token_ids, theirs, logits, "gemma3 1P1D, second turn")
    hit = (len(first) + len(answer) - 1) // BLOCK * BLOCK  # the last answer token's KV was never computed
    assert driver.decode_stats().prefix_cache_hits - hits_before == hit
    firsts = [hit if w is None else max(hit, max(0, len(second) - w + 1) // BLOCK * BLOCK) for w in windows]
    expected = sum(len(second) - f for f in firsts) * LAYER_TOKEN_BYTES
    assert driver.prefill_stats().kv_bytes_sent - sent_before == expected
    assert_no_leaks(driver)
