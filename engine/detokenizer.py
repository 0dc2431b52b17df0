"""Incremental detokenization with stop strings.

Text is produced from a sliding window of token ids so multi-byte characters split across tokens are
emitted only once complete, and leading-space rules of the tokenizer see a little context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.control.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the first output tokens, for spacing rules


def decoder_of(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text, exactly as `tokenizer.decode(ids, skip_special_tokens=...)`. For a fast tokenizer that
    does no clean-up of spaces, that is its Rust backend's decode: transformers' wrapper adds ~12 us a call
    in Python, and the router decodes twice per streamed token (docs/results.md, router overhead)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Output tokens -> text, with stop strings applied as vLLM (v1) applies them:
      * text made within the first `min_tokens` output tokens never matches a stop string: a match must
        end in text that came after them (one that starts before them counts);
      * a matched stop string ends the text (truncated before it, or after it with
        include_stop_str_in_output), and `stopped_by` names it;
      * the engine's stop token (EOS, or one of stop_token_ids: `add_tokens(..., ends_with_stop_token=True)`)
        counts as output but its text is left out, unless include_stop_str_in_output."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), *, min_tokens: int = 0, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = decoder_of(tokenizer, skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.num_output_tokens = 0
        self.text = ""  # all output text so far (truncated at a matched stop string)
        self._num_emitted = 0  # characters of self.text already handed out
        self.stopped_by: str | None = None
        # while streaming, a stop string may still be forming at the end of the text: hold that many
        # characters back (none when a matched stop string stays in the text anyway)
        self._holdback = 0
        if self.stop and not include_stop_str_in_output:
            self._holdback = max(len(s) for s in self.stop) - 1

    @classmethod
    def for_params(cls, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of a request's SamplingParams."""
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                   min_tokens=params.min_tokens, include_stop_str_in_output=params.include_stop_str_in_output)

    def add_tokens(self, token_ids: list[int], ends_with_stop_token: bool = False) -> None:
        """Output tokens, in order; nothing more is taken once a stop string matched. `ends_with_stop_token`:
        the last one is the engine's stop token (its delta finished with "stop")."""
        for position, token_id in enumerate(token_ids):
            if self.stopped_by is not None:
                return
            self.num_output_tokens += 1
            if ends_with_stop_token and position == len(token_ids) - 1 and not self.include_stop_str_in_output:
                return  # vLLM leaves the stop token's text out
            self._ids.append(token_id)
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._append_text(full[len(prefix):])
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _append_text(self, new_text: str) -> None:
        new_from = len(self.text)
        self.text += new_text
        if self.stop and self.num_output_tokens > self.min_tokens:  # text of earlier tokens was searched, or
            self._match_stop_strings(new_from)  # came within min_tokens: only a match ending in new_text counts

    def _match_stop_strings(self, new_from: int) -> None:
        """The earliest stop string that ends after `new_from` ends the text."""
        matches = [(index, stop) for stop in self.stop
                   if (index := self.text.find(stop, max(0, new_from - len(stop) + 1))) != -1]
        if matches:
            index, self.stopped_by = min(matches)
            end = index + len(self.stopped_by) if self.include_stop_str_in_output else index
            self.text = self.text[:end]

    def take_new_text(self, finished: bool = False) -> str:
        """Text not handed out yet; while running, the last characters that might start a stop string wait."""
        end = len(self.text) if finished or self.stopped_by else max(self._num_emitted, len(self.text) - self._holdback)
        new_text = self.text[self._num_emitted:end]
        self._num_emitted = end
        return new_text
