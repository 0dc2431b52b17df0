"""Sliding windows, logit soft-capping and attention sinks on pdserve's runtime: greedy fp32 output equals
transformers' generate() token for token, colocated and disaggregated (prefill and decode processes over
the real KV link), with prompts several times longer than the window and no KV block left behind.

  mistral  native code, every layer slides (window 7: not a multiple of the 4-token block)
  gemma2   alternating local/global layers, attention soft cap, final logit soft cap, query_pre_attn_scalar
  gemma3   5 local : 1 global layers, each kind with its own rope theta, query_pre_attn_scalar
  gpt-oss  attention sinks, alternating local/global layers (its experts are transformers' own code)
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from pdserve.kernels import dispatch
from tests.decode.test_disaggregated import PROMPTS, assert_no_leaks, running_pair
from tests.engine.parity import assert_greedy_match, hf_greedy
from tests.engine.test_llm_parity import GREEDY_WITH_LOGPROBS, assert_matches_transformers, make_prompts, run_parity
from tests.engine.test_transformers_backend import make_hf_model_dir

WINDOW = 8
NUM_KV_BLOCKS = 256
HF_CASES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "num_key_value_heads": 2, "sliding_window": WINDOW, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 10.0, "query_pre_attn_scalar": 24,
    }),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "num_key_value_heads": 2, "sliding_window": WINDOW, "num_hidden_layers": 6,
        "query_pre_attn_scalar": 24,
    }),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 16, "num_key_value_heads": 2, "sliding_window": WINDOW, "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }),
}
# Each layer's (sliding window, soft cap, has sinks) as bound to pdserve's attention.
EXPECTED_LAYERS = {
    "mistral": [(7, None, False)] * 2,
    "gemma2": [(WINDOW, 5.0, False), (None, 5.0, False)],
    "gemma3": [(WINDOW, None, False)] * 5 + [(None, None, False)],
    "gpt-oss": [(WINDOW, None, True), (None, None, True)],
}
CASES = list(EXPECTED_LAYERS)
HYBRID_CASES = ["gemma2", "gemma3", "gpt-oss"]  # sliding and full layers: a block table per layer group
# A pool that a few long prompts overflow: (full groups x 21 + sliding groups x 7) blocks hold one 70-token prompt
SMALL_POOLS = {"gemma2": 30, "gemma3": 60, "gpt-oss": 30}


@pytest.fixture(scope="module")
def case_model_dir(model_factory, tmp_path_factory):
    built: dict[str, str] = {}

    def make(case: str) -> str:
        if case not in built:
            if case == "mistral":
                built[case] = model_factory("mistral", sliding_window=7)
            else:
                config_class, architecture, fields = HF_CASES[case]
                built[case] = make_hf_model_dir(tmp_path_factory.mktemp(f"hf-{case}"), config_class, architecture,
                                                model_factory("llama"), **fields)
        return built[case]

    return make


def _bound_layers(llm: LLM) -> list[tuple[int | None, float | None, bool]]:
    modules = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "Attention"]
    return [(m.sliding_window, m.soft_cap, m.sinks is not None) for m in sorted(modules, key=lambda m: m.layer_idx)]


@pytest.mark.parametrize("case", CASES)
def test_colocated_greedy_matches_transformers(case_model_dir, case):
    """Chunked prefills (16-token budget) cross the window mid-prompt; decodes run far past it."""
    llm = run_parity(case_model_dir(case), make_prompts(1024, seed=4), max_num_batched_tokens=16,
                     num_kv_blocks=NUM_KV_BLOCKS)
    assert _bound_layers(llm) == EXPECTED_LAYERS[case]
    assert llm.model_config.max_model_len == llm.model_config.max_position_embeddings  # no cap at the window
    assert isinstance(llm.kv_cache_manager, HybridKVCacheManager) == (case in HYBRID_CASES)


def _record_peak_use(llm: LLM, monkeypatch) -> list[int]:
    manager, seen = llm.kv_cache_manager, []
    allocate = manager.allocate_slots

    def recording(*args, **kwargs):
        blocks = allocate(*args, **kwargs)
        seen.append(manager.num_used_blocks)
        return blocks

    monkeypatch.setattr(manager, "allocate_slots", recording)
    return seen


@pytest.mark.parametrize("case", HYBRID_CASES)
def test_sliding_groups_hold_only_their_window(case_model_dir, case, monkeypatch):
    """One 70-token prompt, chunks of 16: each sliding group holds at most its window and a chunk, each full
    group every block; transformers' tokens all the same, and nothing left behind."""
    model_dir = case_model_dir(case)
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16)
    manager = llm.kv_cache_manager
    used = _record_peak_use(llm, monkeypatch)
    prompt = make_prompts(1024, seed=6)[7]
    outputs = llm.generate([{"prompt_token_ids": prompt}], GREEDY_WITH_LOGPROBS)
    assert_matches_transformers(model_dir, [prompt], outputs)
    num_tokens = len(prompt) + GREEDY_WITH_LOGPROBS.max_tokens
    without_freeing = len(manager.groups) * -(-(num_tokens - 1) // 4)
    assert max(used) <= manager.max_blocks_held(num_tokens, 16) < without_freeing
    assert manager.num_used_blocks == 0
    manager.check_invariants()


@pytest.mark.parametrize("case", HYBRID_CASES)
def test_sliding_groups_keep_parity_through_preemption_and_prefix_hits(case_model_dir, case):
    """A pool so small that requests are preempted and recompute; then the same prompts again, served from
    cached blocks (sliding ones that had left the window included)."""
    model_dir = case_model_dir(case)
    prompts = make_prompts(1024, seed=7)
    llm = run_parity(model_dir, prompts, max_num_batched_tokens=16, num_kv_blocks=SMALL_POOLS[case])
    assert llm.engine.scheduler.num_preemptions > 0
    before = llm.engine.stats().prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    assert llm.engine.stats().prefix_cache_hits > before
    assert_matches_transformers(model_dir, prompts, again, label="cached run, ")
    assert llm.kv_cache_manager.num_used_blocks == 0
    llm.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("case", CASES)
def test_disaggregated_greedy_matches_transformers(case_model_dir, case, tmp_path):
    """P computes the prompt (70 tokens: nine windows), D continues from the KV it received."""
    model_dir = case_model_dir(case)
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with running_pair(model_dir, tmp_path) as driver:
        results = driver.generate(PROMPTS, **greedy)
        for prompt, result in zip(PROMPTS, results):
            theirs, logits = hf_greedy(reference, prompt, greedy["max_tokens"])
            assert_greedy_match(result.token_ids, theirs, logits, f"{case} 1P1D prompt of {len(prompt)}")
        stats = driver.decode_stats()
        assert stats.num_kv_transfers_failed == 0 and stats.kv_bytes_received > 0
        assert_no_leaks(driver)


@pytest.mark.parametrize("case", ["gemma2", "gpt-oss"])
def test_triton_backend_greedy_matches_transformers(case_model_dir, case, monkeypatch):
    """The Triton kernels (interpreted on CPU, compiled on a GPU) with windows, soft caps and sinks."""
    from pdserve.kernels.triton_utils import INTERPRET

    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU")
    monkeypatch.setattr(dispatch, "FORCED_BACKEND", "triton")
    model_dir = case_model_dir(case)
    prompts = [p for p in make_prompts(1024, seed=5) if len(p) in (5, 17, 31)]
    device = "cpu" if INTERPRET else "cuda"
    llm = LLM(model_dir, dtype="float32", device=device, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.runner.attn_backend.name == "triton"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        theirs, logits = hf_greedy(reference, prompt, 6)
        completion = output.outputs[0]
        assert_greedy_match(completion.token_ids, theirs, logits, f"{case} triton, prompt of {len(prompt)}",
                            completion.logprobs)
    assert llm.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("case", CASES)
def test_bf16_greedy_matches_transformers_within_rounding(case_model_dir, case):
    """bf16 on both sides: equal tokens, or a divergence at a top-2 gap within bf16 rounding (tests.engine.parity)."""
    model_dir = case_model_dir(case)
    prompts = [p for p in make_prompts(1024, seed=8) if len(p) >= 17]  # past the window
    llm = LLM(model_dir, dtype="bfloat16", block_size=4, num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    for prompt, output in zip(prompts, outputs):
        theirs, logits = hf_greedy(reference, prompt, 8)
        completion = output.outputs[0]
        assert_greedy_match(completion.token_ids, theirs, logits, f"{case} bf16, prompt of {len(prompt)}",
                            completion.logprobs, dtype=torch.bfloat16)
    assert llm.kv_cache_manager.num_used_blocks == 0
