"""The most text one token of the loaded tokenizer can cover, read from its vocabulary: a prompt longer
than max_model_len such tokens cannot fit the context, so it is refused before it is tokenized (encoding
a few MiB of text takes hundreds of MB). Exact for BPE tokenizers whose normalizer and pre-tokenizer
never drop text; for any other tokenizer there is no bound and every prompt is tokenized.

    bound = PromptBound.of(tokenizer)      # None: no exact bound for this tokenizer
    bound.min_tokens(text)                 # the fewest tokens `text` can encode to
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

# normalizers that never shorten text, or shorten it in a way recomputed here (the Unicode forms)
UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


@dataclass(frozen=True)
class PromptBound:
    max_token_len: int  # the longest token's text: bytes for a byte-level tokenizer, else characters
    in_bytes: bool
    unicode_form: str | None  # the normalizer's Unicode form, applied before the text is measured

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBound | None:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        model = spec.get("model") or {}
        fused_unknowns = model.get("fuse_unk") and model.get("unk_token") and not model.get("byte_fallback")
        if model.get("type") != "BPE" or fused_unknowns:
            return None  # WordPiece, Unigram, WordLevel: one unknown token may stand for a whole word
        unicode_form = _unicode_form(spec.get("normalizer"))
        pre_tokenizers = _parts(spec.get("pre_tokenizer"), "pretokenizers")
        if unicode_form is False or pre_tokenizers is None or not all(_lossless(p) for p in pre_tokenizers):
            return None
        in_bytes = any(p.get("type") == "ByteLevel" for p in pre_tokenizers)
        # a byte-level vocabulary spells each byte as one character; added tokens are matched in the raw text
        added = [token["content"] for token in spec.get("added_tokens", ())]
        longest = max([len(token) for token in model.get("vocab") or ()] +
                      [len(text.encode()) if in_bytes else len(text) for text in added])
        return cls(longest, in_bytes, unicode_form or None)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to (special tokens added only raise it)."""
        if self.unicode_form is not None:
            text = unicodedata.normalize(self.unicode_form, text)
        length = len(text.encode()) if self.in_bytes and not text.isascii() else len(text)
        return -(-length // self.max_token_len)

    def unit(self) -> str:
        return "bytes" if self.in_bytes else "characters"


def _parts(spec: dict | None, key: str) -> list[dict] | None:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        parts = [_parts(part, key) for part in spec.get(key, ())]
        return None if any(part is None for part in parts) else [p for part in parts for p in part]
    return [spec]


def _unicode_form(spec: dict | None) -> str | bool:
    """The normalizer's Unicode form ("" for none); False when it may shorten text some other way."""
    parts = _parts(spec, "normalizers")
    forms = [p["type"] for p in parts or () if p.get("type") in UNICODE_FORMS]
    others = [p for p in parts or () if p.get("type") not in UNICODE_FORMS]
    if parts is None or len(forms) > 1 or not all(_lengthening(p) for p in others):
        return False
    return forms[0] if forms else ""


def _lengthening(normalizer: dict) -> bool:
    """Prepend adds text; a Replace of a plain string by one as long or longer never shortens it."""
    kind = normalizer.get("type")
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        return "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"])
    return False


def _lossless(pre_tokenizer: dict) -> bool:
    """Splits that keep every character (one that removes its matches drops text)."""
    return pre_tokenizer.get("type") in LOSSLESS_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"
