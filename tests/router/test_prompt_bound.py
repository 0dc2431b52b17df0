"""The shortest encoding a text can have, from the tokenizer's longest token: never above the real token
count (a prompt it refuses could not have fit), and refused only for tokenizers where it is exact."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.router.prompt_bound import PromptBound

TRAINING_TEXT = ["the quick brown fox jumps over the lazy dog", "==========", "          indented code",
                 "décodé données 数据 한국어", "naïve café résumé"] * 50


def sample_texts() -> list[str]:
    rng = random.Random(0)
    alphabet = "ab =\n\t.é数한\u0301\u1100\u1161\u11a8ω\u0313\u0345<|>"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(200)]
    return texts + ["=" * 5000, " " * 3000, "数据" * 500, "e\u0301" * 700, "\u1100\u1161\u11a8" * 300,
                    "<|im_start|>" * 100, "the quick brown fox " * 200]


def wrapped(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def trained_bpe(normalizer, pre_tokenizer, byte_fallback: bool = False) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token=None if byte_fallback else "<unk>", byte_fallback=byte_fallback))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if byte_fallback else []
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<|im_start|>", *byte_tokens],
                                  show_progress=False)
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return wrapped(tokenizer)


def assert_a_lower_bound(tokenizer, bound: PromptBound) -> None:
    for text in sample_texts():
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert bound.min_tokens(text) <= num_tokens, (text[:60], bound)


def test_the_demo_tokenizer_bound_is_its_longest_token_in_bytes_and_never_above_the_real_count(tokenization):
    bound = tokenization.prompt_bound
    longest = max(len(token) for token in tokenization.tokenizer.get_vocab())
    assert bound == PromptBound(max(longest, len("<|begin_of_text|>")), in_bytes=True, unicode_form="NFC")
    assert_a_lower_bound(tokenization.tokenizer, bound)
    assert bound.min_tokens("=" * 5000) > 1  # a bound that can refuse something


def test_a_metaspace_tokenizer_with_byte_fallback_is_bounded_in_characters():
    tokenizer = trained_bpe(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                            pre_tokenizers.Metaspace(), byte_fallback=True)
    bound = PromptBound.of(tokenizer)
    assert bound is not None and not bound.in_bytes and bound.unicode_form is None
    assert_a_lower_bound(tokenizer, bound)


@pytest.mark.parametrize("normalizer, pre_tokenizer", [
    (normalizers.Lowercase(), pre_tokenizers.ByteLevel()),  # may change a text's length
    (normalizers.Strip(), pre_tokenizers.ByteLevel()),  # drops characters
    (normalizers.Replace("  ", " "), pre_tokenizers.ByteLevel()),  # shortens
    (None, pre_tokenizers.Whitespace()),  # drops whitespace
    (None, pre_tokenizers.Split(" ", behavior="removed")),
])
def test_tokenizers_that_may_drop_text_have_no_bound(normalizer, pre_tokenizer):
    assert PromptBound.of(trained_bpe(normalizer, pre_tokenizer)) is None


def test_a_wordpiece_tokenizer_has_no_bound():
    tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))  # one [UNK] for a whole word
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.WordPiece()
    assert PromptBound.of(wrapped(tokenizer)) is None
