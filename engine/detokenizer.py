"""Incremental detokenization with stop strings.

Text is produced from a sliding window of token ids so multi-byte characters split across tokens are
emitted only once complete, and leading-space rules of the tokenizer see a little context.
"""

from __future__ import annotations

from collections.abc import Callable

_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output tokens, for spacing rules


def decoder_of(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text, exactly as `tokenizer.decode(ids, skip_special_tokens=...)`. For a fast tokenizer that
    does no clean-up of spaces, that is its Rust backend's decode: transformers' wrapper adds ~12 us a call
    in Python, and the router decodes twice per streamed token (docs/BENCHMARKS.md, issue #17)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = decoder_of(tokenizer, skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all output text so far (truncated before a matched stop string)
        self._num_emitted = 0  # characters of self.text already handed out
        self.stopped_by: str | None = None
        # a stop string may still be forming at the end of the text: hold that many characters back
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add_tokens(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if self.stopped_by is not None:
                return
            self._ids.append(token_id)
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._append_text(full[len(prefix):])
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _append_text(self, new_text: str) -> None:
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text
        matches = [(index, stop) for stop in self.stop if (index := self.text.find(stop, search_from)) != -1]
        if matches:
            index, self.stopped_by = min(matches)
            self.text = self.text[:index]

    def take_new_text(self, finished: bool = False) -> str:
        """Text not handed out yet; while running, the last characters that might start a stop string wait."""
        end = len(self.text) if finished or self.stopped_by else max(self._num_emitted, len(self.text) - self._holdback)
        new_text = self.text[self._num_emitted:end]
        self._num_emitted = end
        return new_text
