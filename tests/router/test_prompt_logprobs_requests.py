"""The request rules of prompt logprobs (router/specs.py): echo with logprobs and vLLM's prompt_logprobs
ask the engines for them (once per prompt, on sample 0), prompt_logprobs is not streamed, and max_tokens=0
is the prompt alone with echo and a 400 without."""

from __future__ import annotations

import pytest

from pdserve.router.errors import InvalidRequest
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.specs import chat_specs, completion_specs

MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT = [[7, 8, 9]]


def completion(prompts=PROMPT, **fields):
    return completion_specs(CompletionRequest(prompt="x", **fields), prompts, 512, None, 16)


def chat(**fields):
    return chat_specs(ChatCompletionRequest(messages=MESSAGES, **fields), [7, 8, 9], 512, 16)


@pytest.mark.parametrize("fields, asked", [
    ({}, None),
    ({"logprobs": 2}, None),  # the generated tokens' only
    ({"echo": True}, None),
    ({"echo": True, "logprobs": 0}, 0),
    ({"echo": True, "logprobs": 3}, 3),
    ({"prompt_logprobs": 0}, 0),
    ({"prompt_logprobs": 5, "logprobs": 1}, 5),
    ({"echo": True, "logprobs": 4, "prompt_logprobs": 2}, 4),  # one computation serves both: the larger
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 6}, 6),
])
def test_the_engines_are_asked_for_what_the_response_shows(fields, asked):
    spec, = completion(**fields)
    assert spec.sampling_params.prompt_logprobs == asked
    assert spec.reports_prompt_logprobs == (asked is not None)
    assert not spec.prompt_only


def test_chat_takes_prompt_logprobs():
    spec, = chat(prompt_logprobs=3)
    assert spec.sampling_params.prompt_logprobs == 3 and spec.sampling_params.logprobs is None
    assert chat()[0].sampling_params.prompt_logprobs is None


@pytest.mark.parametrize("make", [lambda: completion(prompt_logprobs=1, stream=True),
                                  lambda: chat(prompt_logprobs=0, stream=True)])
def test_prompt_logprobs_are_refused_with_stream_by_name(make):
    with pytest.raises(InvalidRequest) as refused:
        make()
    error = refused.value
    assert (error.param, error.status_code) == ("prompt_logprobs", 400)
    assert "not available when stream is enabled" in error.message and "stream to false" in error.message


def test_echo_with_logprobs_may_stream():
    spec, = completion(echo=True, logprobs=1, stream=True)
    assert spec.sampling_params.prompt_logprobs == 1


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_is_a_validation_error(value):
    for model, extra in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MESSAGES})):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            model(prompt_logprobs=value, **extra)


def test_max_tokens_zero_with_echo_is_the_prompt_alone():
    spec, = completion(echo=True, max_tokens=0, logprobs=1)
    assert spec.prompt_only
    assert spec.sampling_params.max_tokens == 1, "the engines make one token, which the router drops"
    assert spec.sampling_params.prompt_logprobs == 1


def test_max_tokens_zero_without_echo_is_refused_with_the_fix():
    with pytest.raises(InvalidRequest) as refused:
        completion(max_tokens=0)
    assert refused.value.param == "max_tokens" and "echo=true" in refused.value.message
    with pytest.raises(InvalidRequest) as refused:
        completion(max_tokens=0, echo=True, min_tokens=2)
    assert refused.value.param == "min_tokens" and "max_tokens=0" in refused.value.message
    with pytest.raises(InvalidRequest, match="context length"):  # the engines' one token must fit
        completion_specs(CompletionRequest(prompt="x", echo=True, max_tokens=0), [[1] * 512], 512, None, 16)
    with pytest.raises(ValueError, match="max_tokens"):
        ChatCompletionRequest(messages=MESSAGES, max_tokens=0)


def test_n_samples_compute_the_prompt_logprobs_once_and_all_report_them():
    specs = completion(prompts=[[7, 8, 9], [4, 5]], n=3, echo=True, logprobs=2, seed=10)
    assert [s.sampling_params.prompt_logprobs for s in specs] == [2, None, None] * 2
    assert [s.sampling_params.seed for s in specs] == [10, 11, 12] * 2, "the samples keep distinct seeds"
    assert all(s.reports_prompt_logprobs for s in specs)
    first, second = specs[0].shared_prompt_logprobs, specs[3].shared_prompt_logprobs
    assert first is not None and second is not None and first is not second, "one set per prompt"
    assert all(s.shared_prompt_logprobs is first for s in specs[:3])
    assert all(s.shared_prompt_logprobs is None for s in completion(n=3, logprobs=2))
    alone, = completion(prompt_logprobs=1)
    assert alone.shared_prompt_logprobs is None, "one sample needs nothing shared"
    assert [s.sampling_params.prompt_logprobs for s in chat(n=2, prompt_logprobs=4)] == [4, None]
