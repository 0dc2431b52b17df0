"""Incremental detokenization: multi-byte characters, stop strings, hold-back while streaming."""

from __future__ import annotations

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer, decoder_of
from pdserve.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return load_tokenizer(model_factory("llama"))


def stream(tokenizer, text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
    pieces = []
    for token_id in tokenizer.encode(text):
        detok.add_tokens([token_id])
        pieces.append(detok.take_new_text())
        if detok.stopped_by:
            break
    pieces.append(detok.take_new_text(finished=True))
    return pieces, detok


def test_multibyte_text_streams_without_broken_characters(tokenizer):
    text = "héllo wörld 日本語 🙂 done"
    pieces, detok = stream(tokenizer, text)
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in piece for piece in pieces)


def test_stop_string_truncates_and_ends(tokenizer):
    pieces, detok = stream(tokenizer, "alpha beta STOP gamma delta", stop=("STOP",))
    assert detok.stopped_by == "STOP"
    assert "".join(pieces) == detok.text == "alpha beta "


def test_partial_stop_string_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("xyz!",))
    detok.add_tokens(tokenizer.encode("abc xy"))
    assert not detok.take_new_text().endswith("xy"), "a possible stop prefix must wait"
    detok.add_tokens(tokenizer.encode(" more"))
    assert detok.stopped_by is None
    assert detok.take_new_text(finished=True).endswith("more")
    assert detok.text == "abc xy more"


def test_earliest_stop_string_wins(tokenizer):
    _, detok = stream(tokenizer, "one two three four", stop=("four", "two"))
    assert detok.text == "one " and detok.stopped_by == "two"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_decoder_equals_the_tokenizers_decode(tokenizer, skip_special_tokens):
    """The backend shortcut must give transformers' text exactly: special tokens, bytes of a split
    character, spaces."""
    assert tokenizer.clean_up_tokenization_spaces is False  # so the shortcut is the one under test
    ids = tokenizer.encode("héllo wörld, 1 2  3 ✓ end") + [tokenizer.eos_token_id] + tokenizer.encode(" again")
    decode = decoder_of(tokenizer, skip_special_tokens)
    for start in range(len(ids)):
        for end in range(start, len(ids) + 1):
            assert decode(ids[start:end]) == tokenizer.decode(ids[start:end], skip_special_tokens=skip_special_tokens)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    calls = []
    original = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or original(ids, **kw))
    decoder_of(tokenizer, True)([5, 6])
    assert calls == [[5, 6]]


# ---- vLLM (v1)'s stop rules: min_tokens, include_stop_str_in_output, the engine's stop token ----

def token_texts(tokenizer, text: str) -> tuple[list[int], list[str]]:
    """The ids of `text` and the text each one adds (all non-empty for this ASCII text)."""
    ids, detok, texts = tokenizer.encode(text), IncrementalDetokenizer(tokenizer, []), []
    for token_id in ids:
        detok.add_tokens([token_id])
        texts.append(detok.take_new_text())
    assert all(texts) and "".join(texts) == text
    return ids, texts


def run(tokenizer, ids: list[int], **options) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, [], **options)
    for token_id in ids:
        detok.add_tokens([token_id])
        if detok.stopped_by:
            break
    return detok


def test_text_within_min_tokens_never_matches_a_stop_string(tokenizer):
    ids, texts = token_texts(tokenizer, "alpha STOP beta STOP gamma")
    within = next(i for i in range(len(texts)) if "STOP" in "".join(texts[:i + 1])) + 1  # tokens up to 1st STOP
    detok = run(tokenizer, ids, stop=("STOP",), min_tokens=within)
    assert detok.stopped_by == "STOP" and detok.text == "alpha STOP beta ", "the second STOP ends it"
    detok = run(tokenizer, ids, stop=("STOP",), min_tokens=within - 1)
    assert detok.text == "alpha ", "a match that ends after min_tokens counts, though it starts within them"


def test_a_stop_string_is_looked_for_only_once_past_min_tokens(tokenizer):
    ids, texts = token_texts(tokenizer, "one two three four")
    full, unmatched = "".join(texts), 0
    for min_tokens in range(1, len(ids)):
        inside, spanning = texts[min_tokens - 1], texts[min_tokens - 1][-1] + texts[min_tokens][0]
        detok = run(tokenizer, ids, stop=(inside,), min_tokens=min_tokens)
        boundary = len("".join(texts[:min_tokens]))
        if inside not in full[boundary - len(inside) + 1:]:  # no match can end after min_tokens' text
            assert detok.stopped_by is None and detok.text == full, min_tokens
            unmatched += 1
        detok = run(tokenizer, ids, stop=(spanning,), min_tokens=min_tokens)
        assert detok.stopped_by == spanning, min_tokens
        assert detok.text == "".join(texts[:min_tokens])[:-1], "cut before the match, within min_tokens' text"
    assert unmatched >= len(ids) // 2


def test_include_stop_str_in_output_keeps_the_stop_string_and_holds_nothing_back(tokenizer):
    ids, texts = token_texts(tokenizer, "alpha beta STOP gamma")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",), include_stop_str_in_output=True)
    pieces = []
    for token_id in ids:
        detok.add_tokens([token_id])
        pieces.append(detok.take_new_text())
        if detok.stopped_by:
            break
    assert detok.stopped_by == "STOP" and detok.text == "".join(pieces) == "alpha beta STOP"
    assert pieces == texts[:len(pieces)], "nothing waits: the text only grows up to the stop string's end"


def test_a_stop_string_ending_mid_token_is_cut_after_it_when_included(tokenizer):
    ids, texts = token_texts(tokenizer, "alpha beta STOP gamma")
    stop = texts[2][:1]  # the first character of a token of several
    assert len(texts[2]) > 1 and stop not in "".join(texts[:2])
    for include, text in ((True, "".join(texts[:2]) + stop), (False, "".join(texts[:2]))):
        detok = run(tokenizer, ids, stop=(stop,), include_stop_str_in_output=include)
        assert detok.text == text and detok.take_new_text(finished=True) == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_engines_stop_token_counts_but_its_text_is_left_out(tokenizer, skip_special_tokens):
    ids = tokenizer.encode("alpha beta")
    for stop_token in (tokenizer.eos_token_id, ids[1]):  # EOS, or a stop_token_ids token
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
        detok.add_tokens(ids + [stop_token], ends_with_stop_token=True)
        assert detok.text == detok.take_new_text(finished=True) == "alpha beta"
        assert detok.num_output_tokens == len(ids) + 1
        kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens, include_stop_str_in_output=True)
        kept.add_tokens(ids + [stop_token], ends_with_stop_token=True)
        assert kept.text == tokenizer.decode(ids + [stop_token], skip_special_tokens=skip_special_tokens)
