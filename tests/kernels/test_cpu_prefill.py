"""The CPU's native bfloat16 prefill attention (kernels.cpu_prefill) against the torch plan it replaces
(kernels.torch_paged: a gather and SDPA): causal rows over a cached prefix, sliding windows, GQA and MHA, head
sizes 32 to 256, several sequences in one call; the same result on one thread and two; the cases it leaves to the
torch plan; and a bf16 engine whose prefill runs on it, greedy-equal to transformers within bf16 rounding."""

from __future__ import annotations

import logging

import pytest
import torch
from pdserve import LLM
from pdserve.kernels import cpu_native, cpu_prefill, torch_paged
from tests.engine.test_llm_parity import GREEDY_WITH_LOGPROBS, assert_matches_transformers
from tests.kernels.test_cpu_native import paged_case

pytestmark = pytest.mark.skipif(cpu_prefill.prefill_kernel() is None,
                                reason=f"no native bf16 prefill kernel: {cpu_prefill.unavailable_reason()}")


def prefill_case(new: list[int], contexts: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, seed: int = 0):
    """test_cpu_native's bf16 caches with each sequence's blocks scattered at random, the new tokens' queries, and
    the step's query offsets and context lengths."""
    _, key_cache, value_cache, tables, seq_lens = paged_case(contexts, num_heads, num_kv_heads, head_dim, block_size,
                                                             torch.bfloat16, seed)
    query = torch.randn(sum(new), num_heads, head_dim, generator=torch.Generator().manual_seed(seed)).bfloat16()
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, tables, starts, seq_lens


CASES = {  # new tokens per sequence, context lengths, num_heads, num_kv_heads, head_dim, block_size
    "one-prompt-gqa-3": ([256], [256], 9, 3, 64, 16),
    "prefixes": ([100, 7, 1], [300, 7, 50], 9, 3, 64, 16),  # cached prefix, a whole prompt, one new token
    "mha-d32-block-of-one": ([70, 5], [70, 9], 4, 4, 32, 1),
    "gqa-8-d128": ([77, 65], [77, 129], 16, 2, 128, 32),
    "d96": ([33, 70], [50, 70], 4, 2, 96, 8),  # a head size with no unrolled copy of the loops
    "d256": ([40], [70], 4, 1, 256, 16),
    "a sequence with no new tokens": ([20, 0, 9], [20, 31, 9], 4, 2, 64, 16),
}


@pytest.mark.parametrize("window", [None, 37, 1])
@pytest.mark.parametrize("case", CASES)
def test_native_prefill_equals_the_torch_plan(case, window):
    new, contexts, num_heads, num_kv_heads, head_dim, block_size = CASES[case]
    query, key_cache, value_cache, tables, starts, lens = prefill_case(new, contexts, num_heads, num_kv_heads,
                                                                       head_dim, block_size)
    plan = torch_paged.plan_prefill(tables, starts, lens, block_size, window)
    # float32 from the same bf16 inputs: the kernel's only roundings are its weights' and its output's to bf16
    exact = torch_paged.prefill_attention_planned(query.float(), key_cache.float(), value_cache.float(), plan, 0.11)
    assert cpu_prefill.supports(query, key_cache, value_cache, None, None)
    got = cpu_prefill.paged_prefill(query, key_cache, value_cache, tables, starts, lens, 0.11, window)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
    sdpa = torch_paged.prefill_attention_planned(query, key_cache, value_cache, plan, 0.11)  # what it replaces
    assert (got.float() - exact).abs().max() <= (sdpa.float() - exact).abs().max() * 2


def test_two_threads_give_the_single_threads_result():
    query, key_cache, value_cache, tables, starts, lens = prefill_case([300, 64, 200], [300, 100, 450], 8, 2, 64, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_prefill.paged_prefill(query, key_cache, value_cache, tables, starts, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_prefill.paged_prefill(query, key_cache, value_cache, tables, starts, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (sequence, KV head, 16 positions) is one thread's work


def test_what_it_leaves_to_the_torch_plan():
    query, key_cache, value_cache, *_ = prefill_case([8], [8], 4, 2, 64, 16)
    assert cpu_prefill.supports(query, key_cache, value_cache, None, None)
    assert not cpu_prefill.supports(query.float(), key_cache.float(), value_cache.float(), None, None)
    assert not cpu_prefill.supports(query, key_cache, value_cache, 30.0, None)  # soft caps
    assert not cpu_prefill.supports(query, key_cache, value_cache, None, torch.zeros(4))  # sinks
    assert not cpu_prefill.supports(query[..., :16], key_cache[..., :16].contiguous(),
                                    value_cache[..., :16].contiguous(), None, None)  # head_dim 16
    assert not cpu_prefill.supports(query, key_cache.transpose(1, 2), value_cache.transpose(1, 2), None, None)


def test_without_the_kernel_prefill_runs_on_sdpa_and_says_why(monkeypatch, caplog):
    from pdserve.engine.attention.torch_paged import TorchPagedBackend

    monkeypatch.setenv(cpu_native.ENV_VAR, "torch")
    monkeypatch.setattr(cpu_native, "_state", {})  # as in a fresh process
    with caplog.at_level(logging.INFO, logger="pdserve.engine.attention.torch_paged"):
        backend = TorchPagedBackend(block_size=16)
    assert not backend.native_prefill
    assert "a gather and torch's SDPA (PDSERVE_CPU_KERNEL=torch)" in caplog.text


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("mistral", {"sliding_window": 11}),  # every layer slides
])
def test_a_bf16_engine_prefills_on_it_and_matches_transformers(model_factory, monkeypatch, arch, overrides):
    """head_dim 32 (tiny's 64 hidden over 2 heads): whole prompts and, with 16 tokens a step, chunks over a cached
    prefix go through the kernel; greedy tokens equal transformers' in bf16 within the rounding rule."""
    model_dir = model_factory(arch, num_attention_heads=2, num_key_value_heads=1, **overrides)
    calls = []
    kernel = cpu_prefill.paged_prefill
    monkeypatch.setattr(cpu_prefill, "paged_prefill", lambda *args: calls.append(args[4].numel() - 1) or kernel(*args))
    llm = LLM(model_dir, dtype="bfloat16", block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    prompts = [list(range(3, 3 + length)) for length in (5, 23, 40)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    assert calls, "the bf16 prefill never reached the native kernel"
    assert_matches_transformers(model_dir, prompts, outputs, f"{arch} bf16, ", dtype=torch.bfloat16)
    assert llm.kv_cache_manager.num_used_blocks == 0
