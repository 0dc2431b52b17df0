"""Prompt logprobs (SamplingParams.prompt_logprobs) from pdserve's own forward equal transformers' log-softmax
at every prompt position: across chunked prefill, batching with other requests, preemption, n > 1 and the
prefix cache (which a request with prompt logprobs must not use)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine import prompt_logprobs
from pdserve.engine.request import Request

ATOL = 1e-4  # float32 on both sides; the engine's paged attention sums in another order


def reference_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] log-softmax of transformers' logits at each prompt position."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs(rows, reference: torch.Tensor, prompt: list[int], k: int) -> None:
    assert rows[0] is None and len(rows) == len(prompt)
    for position in range(1, len(prompt)):
        expected = reference[position - 1]  # the logits at position p - 1 predict prompt token p
        entry = rows[position]
        token = prompt[position]
        assert next(iter(entry)) == token, f"position {position}: the prompt token comes first"
        assert entry[token] == pytest.approx(float(expected[token]), abs=ATOL)
        top_values, top_ids = expected.topk(k)
        assert set(entry) == {token, *top_ids.tolist()}, f"position {position}: the prompt token and the top {k}"
        for token_id, value in zip(top_ids.tolist(), top_values.tolist()):
            assert entry[token_id] == pytest.approx(value, abs=ATOL)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("budget", [7, 64])
def test_prompt_logprobs_match_transformers_chunked_and_batched(model_factory, budget):
    model_dir = model_factory("llama")
    prompts = random_prompts(1024, [2, 5, 17, 40])
    llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        assert_prompt_logprobs(output.prompt_logprobs, reference_logprobs(model_dir, prompt), prompt, 3)
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_prompt_logprobs_zero_is_the_prompt_token_only_and_a_one_token_prompt_has_none(model_factory):
    model_dir = model_factory("qwen3")
    prompt = random_prompts(1024, [9], seed=3)[0]
    llm = LLM(model_dir, dtype="float32", block_size=4)
    one, nine = llm.generate([{"prompt_token_ids": [7]}, {"prompt_token_ids": prompt}],
                             SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert one.prompt_logprobs == [None]
    reference = reference_logprobs(model_dir, prompt)
    assert [list(row) for row in nine.prompt_logprobs[1:]] == [[token] for token in prompt[1:]]
    for position in range(1, len(prompt)):
        assert nine.prompt_logprobs[position][prompt[position]] == pytest.approx(
            float(reference[position - 1, prompt[position]]), abs=ATOL)
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_never_use_the_prefix_cache(model_factory):
    """The same prompt twice: the second is computed again (no hit) and gives the same logprobs."""
    model_dir = model_factory("llama")
    prompt = random_prompts(1024, [30], seed=4)[0]
    llm = LLM(model_dir, dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    hits = llm.engine.stats().prefix_cache_hits
    second = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert llm.engine.stats().prefix_cache_hits == hits
    assert second.prompt_logprobs == first.prompt_logprobs
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.stats().prefix_cache_hits > hits, "a request without prompt logprobs still hits"


def test_n_samples_share_one_prompt_computation(model_factory):
    model_dir = model_factory("llama")
    prompt = random_prompts(1024, [12], seed=5)[0]
    llm = LLM(model_dir, dtype="float32", block_size=4)
    output = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(n=3, seed=1, max_tokens=2, prompt_logprobs=1))[0]
    assert len(output.outputs) == 3
    assert_prompt_logprobs(output.prompt_logprobs, reference_logprobs(model_dir, prompt), prompt, 1)


def test_preempted_prompt_is_not_counted_twice(model_factory):
    """A KV cache too small for all prompts at once preempts some mid-prefill; each prompt's table still
    has exactly one row per position, equal to transformers'."""
    model_dir = model_factory("llama")
    prompts = random_prompts(1024, [23, 23, 23, 23], seed=6)
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=16, max_num_batched_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1))
    assert llm.engine.scheduler.num_preemptions > 0, "the test must preempt"
    for prompt, output in zip(prompts, outputs):
        assert_prompt_logprobs(output.prompt_logprobs, reference_logprobs(model_dir, prompt), prompt, 1)


def test_rows_of_chunk_skip_covered_positions_and_refuse_a_gap():
    request = Request("r", list(range(10)), SamplingParams(prompt_logprobs=1))
    rows = prompt_logprobs.rows_of_chunk(request, 0, 4, first_row=3)
    assert (rows.first_row, rows.targets) == (3, [1, 2, 3, 4])
    request.num_prompt_logprob_positions = 4
    again = prompt_logprobs.rows_of_chunk(request, 0, 6, first_row=0)  # recomputed after a preemption
    assert (again.first_row, again.targets) == (4, [5, 6])
    assert prompt_logprobs.rows_of_chunk(request, 4, 10, first_row=0).targets == [5, 6, 7, 8, 9]
    with pytest.raises(RuntimeError, match="gap"):
        prompt_logprobs.rows_of_chunk(request, 6, 8, first_row=0)
    request.num_prompt_logprob_positions = 9
    assert prompt_logprobs.rows_of_chunk(request, 0, 10, first_row=0) is None  # complete
