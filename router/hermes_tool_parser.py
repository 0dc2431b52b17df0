"""Hermes tool calls read out of a chat answer's text (tool_choice "auto" with --tool-call-parser hermes): the
format of Qwen2.5/Qwen3, Hermes and many other models, free text in which each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. HermesToolParser reads the text as it streams (a
whole answer is one feed) and hands out pieces in order: text, for the message's content, and ParsedCall, for its
tool_calls. Streamed and whole answers therefore agree by construction. docs/serving/api.md has the rules."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass(frozen=True)
class ParsedCall:
    """One call the model made: its place among the answer's calls, the tool, and its arguments as compact JSON."""

    index: int
    name: str
    arguments: str


Piece = str | ParsedCall


class HermesToolParser:
    """The calls and the text of one choice's output, fed as it comes.

    A call is accepted when its JSON is an object whose "name" is one of `tool_names` and whose "arguments"
    (absent: {}) is an object; any other <tool_call> block stays text, tags included. Calls past the first
    `max_calls` are dropped. Text that may be the start of a tag is held until it is known; so is whitespace, since
    whitespace that borders an accepted call is dropped (content "Sure." for "Sure.\\n<tool_call>..."), except that
    text on both sides of calls keeps one run of it between them ("Sure.\\nDone." for "Sure.\\n<tool_call>...
    </tool_call>\\nDone.": the run after the calls, or else the one before them).
    A block the output ends inside (max_tokens) is read up to the end, less a partial closing tag."""

    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        self.tool_names = tool_names
        self.max_calls = max_calls  # parallel_tool_calls false: 1
        self.num_calls = 0
        self._pending = ""  # not handed out yet: a call's body, or what may begin a start tag
        self._inside = False  # _pending is a call's body (its start tag seen, its end tag not)
        self._space = ""  # whitespace held back after the last text handed out
        self._after_call = False  # the last piece was a call: the whitespace after it is dropped
        self._gap = ""  # the whitespace before the calls since the last text: its separator from the next text
        self._wrote_text = False  # text was handed out: text after calls is separated from it

    def feed(self, text: str) -> list[Piece]:
        """The pieces that `text` completes (none while a call or a possible tag is still open)."""
        scan_from = max(0, len(self._pending) - len(END) + 1)  # what was pending holds no whole tag
        self._pending += text
        pieces: list[Piece] = []
        while (at := self._pending.find(END if self._inside else START, scan_from)) >= 0:
            before = self._pending[:at]
            self._pending = self._pending[at + len(END if self._inside else START):]
            pieces += self._close(before, closed=True) if self._inside else self._text(before)
            self._inside, scan_from = not self._inside, 0
        if not self._inside:
            held = len(self._pending) - _tag_start_length(self._pending, START)
            pieces += self._text(self._pending[:held])
            self._pending = self._pending[held:]
        return pieces

    def finish(self) -> list[Piece]:
        """The pieces still held when the output ends: an unclosed call (parsed up to the end), a partial tag
        (text), and trailing whitespace unless it follows a call."""
        pending, self._pending = self._pending, ""
        if self._inside:
            pieces = self._close(pending, closed=False)
        else:
            pieces = self._text(pending)
        self._inside = False
        if self._space and not self._after_call:
            pieces.append(self._space)
        self._space = ""
        return pieces

    def _text(self, text: str) -> list[Piece]:
        """Text outside calls: handed out less its trailing whitespace (held), after the whitespace held before
        it; right after calls, after one run of whitespace when text came before them (none otherwise)."""
        kept = text.rstrip()
        if not kept:
            self._space += text
            return []
        trailing = text[len(kept):]
        if self._after_call:
            separator = self._space + text[:len(text) - len(text.lstrip())] or self._gap
            kept = (separator if self._wrote_text else "") + kept.lstrip()
        else:
            kept = self._space + kept
        self._space, self._after_call, self._gap, self._wrote_text = trailing, False, "", True
        return [kept]

    def _close(self, body: str, *, closed: bool) -> list[Piece]:
        """A <tool_call> block's body: a call, or (not accepted) the block's text. An unclosed block's JSON is
        read without the partial end tag it may end with."""
        call = self._call_of(body if closed else body[:len(body) - _tag_start_length(body, END)])
        if call is None:
            return self._text(START + body + (END if closed else ""))
        if not self._after_call:  # the first of calls in a row: the whitespace before it
            self._gap = self._space
        self._space, self._after_call = "", True
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return []  # a call past parallel_tool_calls false's one: dropped, as vLLM drops it
        self.num_calls += 1
        return [call]

    def _call_of(self, body: str) -> ParsedCall | None:
        try:
            value = json.loads(body, parse_float=_finite_float, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict):
            return None
        name, arguments = value.get("name"), value.get("arguments", {})
        if not (isinstance(name, str) and name in self.tool_names and isinstance(arguments, dict)):
            return None
        return ParsedCall(self.num_calls, name, _compact(arguments))


def _tag_start_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (0 when none). A tag holds one "<", its
    first character, so only the last "<" within reach can begin it."""
    at = text.rfind("<", max(0, len(text) - len(tag) + 1))
    return len(text) - at if at >= 0 and tag.startswith(text[at:]) else 0


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: no JSON number can carry it on
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
