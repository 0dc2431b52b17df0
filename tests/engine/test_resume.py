"""A resumed request (GenerateRequest.resume_token_ids, a migrated stream's output so far) goes on exactly as
the uninterrupted request would: greedy and seeded tokens, max_tokens, logprobs, a structured-output
constraint; bad resumes are refused with errors that name the fix. EngineCore alone, no sockets."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import InvalidRequestError, SamplingParams

PROMPT = [3, 17, 9, 41, 5, 28, 11]


@pytest.fixture(scope="module")
def engine(model_factory):
    return EngineCore(ModelConfig.from_hf(model_factory("llama"), dtype="float32"), CacheConfig(4, 256),
                      SchedulerConfig(max_num_batched_tokens=64))


def run(engine: EngineCore, request_id: str, params: SamplingParams, resume: list[int] = ()):
    """(token ids, logprobs, finish reason) of one request run to its end; the engine is left with no block used."""
    engine.add_request(engine.make_request(request_id, PROMPT, params, resume))
    token_ids, logprobs, finish = [], [], None
    while finish is None:
        for delta in engine.step():
            assert delta.request_id == request_id and delta.finish_reason != "error", delta.error
            token_ids += delta.token_ids
            logprobs += delta.logprobs
            finish = delta.finish_reason
    assert engine.kv_cache_manager.num_used_blocks == 0
    return token_ids, logprobs, finish


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.8, seed=7, repetition_penalty=1.3, ignore_eos=True),
], ids=["greedy", "seeded", "seeded-penalised"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_resumed_request_continues_the_uninterrupted_one(engine, params, cut, request):
    whole, whole_logprobs, finish = run(engine, f"{request.node.name}-whole", params)
    rest, rest_logprobs, rest_finish = run(engine, f"{request.node.name}-rest", params, whole[:cut])
    assert whole[:cut] + rest == whole and rest_finish == finish == "length"
    # the same tokens' logprobs; computed by a prefill of the resumed tokens rather than decode steps, so only to
    # float32 rounding
    assert [list(row) for row in rest_logprobs] == [list(row) for row in whole_logprobs[cut:]]
    for row, expected in zip(rest_logprobs, whole_logprobs[cut:]):
        assert list(row.values()) == pytest.approx(list(expected.values()), abs=1e-4)


def test_a_constraint_is_taken_over_the_resumed_tokens(engine, model_factory):
    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_factory("llama"))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False})
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_kind="json", structured_spec=schema)
    whole, _, finish = run(engine, "json-whole", params)
    rest, _, rest_finish = run(engine, "json-rest", params, whole[:3])
    assert whole[:3] + rest == whole and rest_finish == finish
    json.loads(tokenizer.decode(whole))  # the constraint held across the cut
    with pytest.raises(InvalidRequestError, match="does not fit the request's structured output"):
        engine.make_request("json-bad", PROMPT, params, tokenizer.encode("zz", add_special_tokens=False))


@pytest.mark.parametrize("params, resume, words", [
    (SamplingParams(max_tokens=3), [1, 2, 3], "nothing is left to generate"),
    (SamplingParams(max_tokens=8), [1, 10**6], "outside the vocabulary"),
    (SamplingParams(max_tokens=8, prompt_logprobs=1), [1], "send it without them"),
])
def test_bad_resumes_are_refused_with_the_fix(engine, params, resume, words):
    with pytest.raises(InvalidRequestError, match=words):
        engine.make_request("bad", PROMPT, params, resume)
