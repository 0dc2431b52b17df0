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
