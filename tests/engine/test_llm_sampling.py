"""The offline API end to end with sampling: seeds, stop strings, stop ids, logprobs, text."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("qwen2"), dtype="float32", num_kv_blocks=128, block_size=8)


def token_lists(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = token_lists(llm.generate("Hello there", seeded))
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    in_batch = token_lists(llm.generate(["other prompt", "Hello there", "x"], [unseeded, seeded, unseeded]))
    assert alone[0] == in_batch[1]
    other_seed = token_lists(llm.generate("Hello there", SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)))
    assert other_seed[0] != alone[0]
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_outputs_come_back_in_prompt_order_with_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["a", "bb bb", "ccc ccc ccc"]
    outputs = llm.generate(prompts, greedy)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        completion = output.outputs[0]
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert output.prompt_token_ids == llm.tokenizer.encode(output.prompt)


def test_stop_string_ends_generation_early(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("The cache", greedy)[0].outputs[0]
    words = full.text.split()
    assert len(words) >= 3, f"need a few words of greedy text, got {full.text!r}"
    stop = words[len(words) // 2][:3]
    stopped = llm.generate("The cache", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    completion = stopped[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.text[: full.text.index(stop)]
    assert len(completion.token_ids) < len(full.token_ids)
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_stop_token_id_and_logprobs(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    full = llm.generate("Logprobs please", greedy)[0].outputs[0]
    for token_id, logprobs in zip(full.token_ids, full.logprobs):
        assert token_id in logprobs and len(logprobs) >= 3
        assert max(logprobs.values()) == logprobs[token_id], "greedy picks the most likely token"
    stop_id = full.token_ids[3]
    stopped = llm.generate("Logprobs please", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                             stop_token_ids=[stop_id]))[0].outputs[0]
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id


def test_min_tokens_and_max_tokens(llm):
    """A stop token that would end the request at once is held off for min_tokens outputs (its logit
    is masked, as vLLM and transformers do), then honoured; max_tokens caps the length."""
    first, = token_lists(llm.generate("x", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    stop_at_once = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[first[0]])
    held_off = stop_at_once.replace(min_tokens=4)
    early, late = (out.outputs[0] for out in llm.generate(["x"] * 2, [stop_at_once, held_off]))
    assert early.token_ids == [first[0]] and early.finish_reason == "stop", "without min_tokens it stops at once"
    assert len(late.token_ids) >= 4 and first[0] not in late.token_ids[:4], "masked until the 4th output"
    assert late.finish_reason == "stop" or len(late.token_ids) == 8
    capped = llm.generate("x", SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    assert len(capped.token_ids) == 1 and capped.finish_reason == "length"


def test_a_failing_step_raises_and_the_llm_keeps_working(llm, monkeypatch):
    """EngineCore fails only the step's requests (traceback logged); offline, generate raises their error,
    frees every block, and the next call works."""
    expected = token_lists(llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))

    def broken_sampler(logits, requests):
        raise RuntimeError("sampler broke")

    monkeypatch.setattr(llm.engine.runner, "sampler", broken_sampler)
    with pytest.raises(RuntimeError, match="prompt 0 failed: the engine failed while running.*sampler broke"):
        llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.kv_cache_manager.num_used_blocks == 0
    monkeypatch.undo()
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert token_lists(llm.generate("Hello there", greedy)) == expected
    assert llm.kv_cache_manager.num_used_blocks == 0
