"""Properties of the sampler over random inputs (hypothesis): every SamplingParams that validates
samples without raising, in the vocabulary, with finite logprobs; every out-of-range value is refused
by SamplingParams itself, before any engine sees it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.control.errors import InvalidRequestError
from pdserve.control.sampling_params import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from pdserve.control.schema import INT64_MIN, MAX_TOKEN_ID, MAX_TOKENS, UINT64_MAX
from pdserve.engine.layers.sampler import Sampler
from pdserve.engine.request import Request

VOCAB_SIZE = 80  # more than the stop ids and eos min_tokens can ban, so a row always keeps a token
EOS = 2
FLOAT32_MAX = torch.finfo(torch.float32).max

# Edge values first: hypothesis draws them often next to the ranges' interiors.
temperatures = st.one_of(st.sampled_from([0.0, 1e-45, 1e-6, 1e-5, 1.0, MAX_TEMPERATURE]),
                         st.floats(0.0, MAX_TEMPERATURE))
repetition_penalties = st.one_of(st.sampled_from([MIN_REPETITION_PENALTY, 1.0, MAX_REPETITION_PENALTY]),
                                 st.floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY))
probabilities = st.one_of(st.sampled_from([0.0, 5e-324, 1e-45, 1e-39, 0.5, 1.0]), st.floats(0.0, 1.0))
top_ps = st.one_of(st.sampled_from([5e-324, 1e-46, 1e-8, 1.0]), st.floats(0.0, 1.0, exclude_min=True))
penalties = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2.0, 2.0))
seeds = st.one_of(st.none(), st.sampled_from([INT64_MIN, -1, 0, (1 << 63) - 1, UINT64_MAX]),
                  st.integers(INT64_MIN, UINT64_MAX))


@st.composite
def valid_params(draw) -> SamplingParams:
    return SamplingParams(
        temperature=draw(temperatures),
        top_p=draw(top_ps),
        top_k=draw(st.one_of(st.integers(-1, VOCAB_SIZE + 2), st.just(MAX_TOKEN_ID))),
        min_p=draw(probabilities),
        seed=draw(seeds),
        repetition_penalty=draw(repetition_penalties),
        presence_penalty=draw(penalties),
        frequency_penalty=draw(penalties),
        min_tokens=draw(st.integers(0, 4)),
        stop_token_ids=draw(st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), st.just(MAX_TOKEN_ID)), max_size=4)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, MAX_TOP_LOGPROBS))),
    )


@st.composite
def requests_and_logits(draw) -> tuple[list[Request], torch.Tensor]:
    num_rows = draw(st.integers(1, 4))
    token_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=12)
    requests = []
    for row in range(num_rows):
        request = Request(f"r{row}", draw(token_ids) or [0], draw(valid_params()), eos_token_id=EOS)
        for token_id in draw(token_ids):
            request.append_output_token(token_id)
        requests.append(request)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-6, 1.0, 30.0, 1e4, 1e30]))
    logits = torch.randn(num_rows, VOCAB_SIZE, generator=generator) * scale  # [R, V]
    for row in range(num_rows):  # a few entries a model should not produce, but might
        for token_id, value in draw(st.dictionaries(st.integers(0, VOCAB_SIZE - 1),
                                                    st.sampled_from([math.inf, -math.inf, FLOAT32_MAX]),
                                                    max_size=3)).items():
            logits[row, token_id] = value
    return requests, logits


@settings(max_examples=300, deadline=None)
@given(requests_and_logits())
def test_valid_params_sample_a_token_in_the_vocabulary_with_finite_logprobs(batch):
    requests, logits = batch
    out = Sampler()(logits, requests)
    assert len(out.token_ids) == len(requests)
    for request, token_id, logprobs in zip(requests, out.token_ids, out.logprobs):
        assert 0 <= token_id < VOCAB_SIZE
        if request.sampling_params.logprobs is None:
            assert logprobs is None
            continue
        assert token_id in logprobs and all(math.isfinite(value) for value in logprobs.values())
        assert len(logprobs) <= request.sampling_params.logprobs + 1


def _out_of_range(field: str) -> st.SearchStrategy:
    floats = st.floats(allow_nan=True, allow_infinity=True)
    below_above = {
        "temperature": st.one_of(st.floats(max_value=0.0, exclude_max=True), st.floats(min_value=MAX_TEMPERATURE,
                                                                                      exclude_min=True)),
        "repetition_penalty": st.one_of(st.floats(max_value=MIN_REPETITION_PENALTY, exclude_max=True),
                                        st.floats(min_value=MAX_REPETITION_PENALTY, exclude_min=True)),
        "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True)),
        "min_p": st.one_of(st.floats(max_value=0.0, exclude_max=True), st.floats(min_value=1.0, exclude_min=True)),
        "presence_penalty": st.one_of(st.floats(max_value=-2.0, exclude_max=True), st.floats(min_value=2.0,
                                                                                             exclude_min=True)),
        "frequency_penalty": st.one_of(st.floats(max_value=-2.0, exclude_max=True), st.floats(min_value=2.0,
                                                                                              exclude_min=True)),
        "top_k": st.one_of(st.integers(max_value=-2), st.integers(min_value=MAX_TOKEN_ID + 1)),
        "seed": st.one_of(st.integers(max_value=INT64_MIN - 1), st.integers(min_value=UINT64_MAX + 1)),
        "logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_TOP_LOGPROBS + 1)),
        "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_TOKENS + 1)),
        "min_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_TOKENS + 1)),
    }[field]
    if field in ("top_k", "seed", "logprobs", "max_tokens", "min_tokens"):
        return below_above
    return st.one_of(below_above, floats.filter(lambda x: not math.isfinite(x)))


FIELDS = ["temperature", "repetition_penalty", "top_p", "min_p", "presence_penalty", "frequency_penalty", "top_k",
          "seed", "logprobs", "max_tokens", "min_tokens"]


@pytest.mark.parametrize("field", FIELDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_out_of_range_values_are_refused_naming_the_field(field, data):
    value = data.draw(_out_of_range(field))
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


@settings(max_examples=25, deadline=None)
@given(max_tokens=st.integers(1, 100), extra=st.integers(1, 100))
def test_min_tokens_above_max_tokens_is_refused(max_tokens, extra):
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens + extra)
