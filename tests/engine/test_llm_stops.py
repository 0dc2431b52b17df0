"""The offline API applies vLLM (v1)'s stop rules as the router does (tests/router/test_stop_rules.py): no
stop string matches within min_tokens, include_stop_str_in_output keeps the stop string, and the stop
token's text is left out (its id stays)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Hello world"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def greedy(llm):
    """(token ids, the text each one adds) of the prompt's greedy output."""
    prompt_ids = llm.tokenizer.encode(PROMPT)
    full = llm.generate({"prompt_token_ids": prompt_ids}, params())[0].outputs[0]
    texts = token_texts(llm.tokenizer, prompt_ids, full.token_ids)
    assert "".join(texts) == full.text and len(full.token_ids) == MAX_TOKENS
    return full.token_ids, texts


def token_texts(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> list[str]:
    """The text each output token adds, as a stop string sees it."""
    detok, texts = IncrementalDetokenizer(tokenizer, prompt_ids), []
    for token_id in token_ids:
        detok.add_tokens([token_id])
        texts.append(detok.take_new_text())
    return texts


def params(**changes) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **changes})


def first_new(texts: list[str], start: int = 0) -> int:
    """The first token from `start` whose text is visible and not in the text before it."""
    return next(i for i in range(start, len(texts))
                if texts[i].strip() and texts[i] not in "".join(texts[:i + 1])[:-len(texts[i])])


def generate(llm, **changes):
    return llm.generate(PROMPT, params(**changes))[0].outputs[0]


def test_a_stop_string_within_min_tokens_does_not_stop(llm, greedy):
    token_ids, texts = greedy
    at = first_new(texts)
    assert generate(llm, stop=[texts[at]]).token_ids == token_ids[:at + 1], "without min_tokens it stops there"
    held = generate(llm, stop=[texts[at]], min_tokens=at + 1)
    full = "".join(texts)
    assert texts[at] not in full[len("".join(texts[:at + 1])) - len(texts[at]) + 1:], "it does not come again"
    assert (held.text, held.token_ids, held.finish_reason) == (full, token_ids, "length")
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_include_stop_str_in_output(llm, greedy):
    token_ids, texts = greedy
    at = first_new(texts, 1)
    kept = generate(llm, stop=[texts[at]], include_stop_str_in_output=True)
    assert (kept.text, kept.token_ids, kept.stop_reason) == ("".join(texts[:at + 1]), token_ids[:at + 1], texts[at])


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_tokens_text_is_left_out(llm, greedy, include):
    token_ids, texts = greedy
    at = next(i for i in range(1, len(texts)) if texts[i].strip() and token_ids[i] not in token_ids[:i])
    stopped = generate(llm, stop_token_ids=[token_ids[at]], include_stop_str_in_output=include)
    assert stopped.token_ids == token_ids[:at + 1], "the stop token's id stays"
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", token_ids[at])
    assert stopped.text == "".join(texts[:at + 1] if include else texts[:at])
