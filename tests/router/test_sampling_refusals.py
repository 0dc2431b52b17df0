"""router/specs.py's `sampling_params`: a request SamplingParams refuses is a 400 that names the request's
parameter in the request's words (not SamplingParams' "sampling_params.stop"), and the stop fields reach
SamplingParams."""

from __future__ import annotations

import pytest

from pdserve.router.errors import InvalidRequest
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.specs import chat_specs, completion_specs

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": 101}, "temperature", "temperature=101.0 must be at most 100"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "stop has 17 items, over the limit of 16"),
    ({"stop": ["x" * 5000]}, "stop", "stop[0] has 5000 characters"),
    ({"stop_token_ids": [5, -1]}, "stop_token_ids", "stop_token_ids holds -1, which is no token id"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "min_tokens=5 must not exceed max_tokens=2"),
    ({"top_k": 1 << 40}, "top_k", "top_k=1099511627776 must be -1 or 0"),
    ({"repetition_penalty": 0.001}, "repetition_penalty", "repetition_penalty=0.001 must be in [0.01, 100]"),
])
def test_refusals_name_the_requests_parameter(fields, param, words):
    for specs in (lambda: completion_specs(CompletionRequest(prompt="x", **fields), [[7]], 512, None, 8),
                  lambda: chat_specs(ChatCompletionRequest(messages=MESSAGES, **fields), [7], 512, 8)):
        with pytest.raises(InvalidRequest) as refused:
            specs()
        error = refused.value
        assert (error.param, error.status_code) == (param, 400) and words in error.message, error.body()
        assert "sampling_params" not in error.message


def test_a_chat_requests_max_completion_tokens_is_named_as_sent():
    request = ChatCompletionRequest(messages=MESSAGES, min_tokens=5, max_completion_tokens=2)
    with pytest.raises(InvalidRequest) as refused:
        chat_specs(request, [7], 512, 8)
    assert refused.value.param == "min_tokens"
    assert refused.value.message == "min_tokens=5 must not exceed max_completion_tokens=2"


def test_the_stop_fields_reach_sampling_params():
    request = CompletionRequest(prompt="x", stop="END", min_tokens=3, include_stop_str_in_output=True)
    params = completion_specs(request, [[7]], 512, None, 8)[0].sampling_params
    assert (params.stop, params.min_tokens, params.include_stop_str_in_output) == (("END",), 3, True)
    assert not completion_specs(CompletionRequest(prompt="x"), [[7]], 512, None, 8)[0].sampling_params \
        .include_stop_str_in_output


def test_a_chat_requests_max_completion_tokens_past_the_context_is_named_as_sent():
    """It said "max_tokens asks for ..." with `param: "max_tokens"`, a field the request did not send."""
    request = ChatCompletionRequest(messages=MESSAGES, max_completion_tokens=600)
    with pytest.raises(InvalidRequest) as refused:
        chat_specs(request, [7] * 16, 512, 8)
    assert refused.value.param == "max_completion_tokens"
    assert "max_completion_tokens asks for 600 more" in refused.value.message
    assert "lower max_completion_tokens to at most 496" in refused.value.message
    request = ChatCompletionRequest(messages=MESSAGES, max_tokens=600)
    with pytest.raises(InvalidRequest) as refused:
        chat_specs(request, [7] * 16, 512, 8)
    assert refused.value.param == "max_tokens" and "max_tokens asks for 600 more" in refused.value.message
