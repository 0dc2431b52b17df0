"""Greedy fp32 output of pdserve's runtime equals transformers' generate(), token for token."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from tests.engine.parity import assert_greedy_match, hf_greedy

NEW_TOKENS = 12
GREEDY_WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)

ARCH_CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-bias-llama3rope": ("llama", {
        "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "qwen2-qkv-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qknorm-headdim": ("qwen3", {}),
    "mistral": ("mistral", {}),
}


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Lengths around block boundaries, a long one, exact repeats and shared prefixes."""
    rng = random.Random(seed)
    lengths = [1, 3, 4, 5, 8, 17, 31, 70]
    prompts = [[rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]
    prompts.append(list(prompts[6]))  # the same prompt again: a full prefix hit
    prompts.append(prompts[7][:40] + [rng.randrange(5, vocab_size) for _ in range(9)])  # shared prefix
    return prompts


def assert_matches_transformers(model_dir: str, prompts: list[list[int]], outputs, label: str = "",
                                dtype: torch.dtype = torch.float32) -> None:
    """transformers in `dtype` on each prompt: the same greedy tokens (in bf16, within tests.engine.parity's rule)."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        theirs, logits = hf_greedy(reference, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert_greedy_match(completion.token_ids, theirs, logits, f"{label}prompt {i} (len {len(prompt)})",
                            completion.logprobs, dtype=dtype)
        assert completion.finish_reason == "length"


def run_parity(model_dir: str, prompts: list[list[int]], **llm_kwargs) -> LLM:
    llm = LLM(model_dir, dtype="float32", block_size=4, **llm_kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    assert_matches_transformers(model_dir, prompts, outputs)
    assert llm.kv_cache_manager.num_used_blocks == 0
    llm.kv_cache_manager.check_invariants()
    return llm


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_greedy_matches_transformers(model_factory, case):
    arch, overrides = ARCH_CASES[case]
    model_dir = model_factory(arch, **overrides)
    run_parity(model_dir, make_prompts(1024), max_num_batched_tokens=64)


def test_chunked_prefill_and_prefix_hits(model_factory):
    """A 7-token step budget splits every long prompt into chunks mixed with decodes."""
    model_dir = model_factory("llama")
    prompts = make_prompts(1024, seed=1)
    llm = run_parity(model_dir, prompts, max_num_batched_tokens=7)
    assert llm.engine.stats().prefix_cache_hits > 0, "repeated prompts must hit the prefix cache"


def test_prefix_hits_across_generate_calls(model_factory):
    """A second generate call over the same prompts is served from the prefix cache (every full block
    but the one holding the last prompt token) and still equals transformers token for token."""
    model_dir = model_factory("qwen3")
    prompts = make_prompts(1024, seed=2)
    llm = run_parity(model_dir, prompts, max_num_batched_tokens=64)
    before = llm.engine.stats().prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    cacheable = sum((len(p) - 1) // 4 * 4 for p in prompts)  # whole blocks before the last prompt token
    assert llm.engine.stats().prefix_cache_hits - before >= cacheable, "the second call must hit the cache"
    assert_matches_transformers(model_dir, prompts, again, label="cached run, ")
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_preemption_by_tiny_kv_pool(model_factory):
    """24 blocks of 4 tokens cannot hold every request at once: the newest are preempted and recomputed."""
    model_dir = model_factory("llama")
    prompts = make_prompts(1024, seed=3)
    llm = run_parity(model_dir, prompts, max_num_batched_tokens=64, num_kv_blocks=24)
    assert llm.engine.scheduler.num_preemptions > 0


def test_decode_batch_of_very_different_lengths(model_factory):
    """Decode steps whose contexts differ by hundreds of tokens run as several length groups on CPU
    (kernels/torch_paged.py), in an order other than the step's; the tokens still equal transformers'."""
    from pdserve.kernels.torch_paged import group_by_length

    model_dir = model_factory("llama", max_position_embeddings=1024)
    rng = random.Random(4)
    lengths = [3, 480, 40, 900, 250, 700]
    groups = group_by_length([n + 1 for n in lengths])
    assert len(groups) > 2 and [i for group in groups for i in group] != list(range(len(lengths)))
    prompts = [[rng.randrange(5, 1024) for _ in range(n)] for n in lengths]
    run_parity(model_dir, prompts, max_num_batched_tokens=1024)
