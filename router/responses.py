"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions.

A formatter knows one endpoint's shapes; the API code feeds it ChoiceDeltas. Streams are
server-sent events: `data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`. With
stream_options.include_usage every chunk carries "usage": null (the usage so far with vLLM's
continuous_usage_stats) and one last chunk, with no choices, carries the usage. return_token_ids (vLLM's extension) adds prompt_token_ids and token_ids.
Prompt logprobs: completions with echo and logprobs put the prompt's tokens before the generated ones in
`logprobs` (in a stream, in each choice's first chunk); vLLM's prompt_logprobs field, present only when asked,
is per choice on completions and top-level on chat.
Tool calls (router/tool_calls.py): ToolCallFormatter answers with the message's tool_calls instead of its content;
AutoToolCallFormatter (tool_choice "auto") with the calls a tool-call parser reads in the text, and the text around.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response

from pdserve.control.prompt_logprobs import PositionLogprobs
from pdserve.router.choice import ChoiceDelta, PromptRows
from pdserve.router.hermes_tool_parser import ParsedCall, Piece
from pdserve.router.tokenization import Tokenization
from pdserve.router.tool_calls import ToolCalling, new_call_id, tool_call

MIN_LOGPROB = -9999.0  # JSON has no -inf


# json.dumps(obj, ensure_ascii=False, separators=(",", ":")), without building an encoder per call
_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj: Any) -> str:
    return f"data: {_encode_json(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

# whole answers holding more values than this (logprob tables) are built and encoded on a worker thread
OFF_LOOP_VALUES = 20_000
ENCODE_SLICE = 64  # items of a long list encoded per call of the C encoder: it holds the GIL while it runs
_encode_body = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode  # JSONResponse's


def encoded_pieces(obj: Any) -> Iterator[str]:
    """obj as compact JSON in pieces: dicts and short lists walked, long lists encoded ENCODE_SLICE items at
    a time, so no single call holds the GIL for long. "".join of the pieces equals JSONResponse's body
    (for string keys, which every answer has)."""
    if isinstance(obj, dict):
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield ("," if i else "") + _encode_body(str(key)) + ":"
            yield from encoded_pieces(value)
        yield "}"
    elif isinstance(obj, list) and len(obj) > ENCODE_SLICE:
        yield "["
        for start in range(0, len(obj), ENCODE_SLICE):
            yield ("," if start else "") + _encode_body(obj[start:start + ENCODE_SLICE])[1:-1]
        yield "]"
    elif isinstance(obj, list):
        yield "["
        for i, item in enumerate(obj):
            if i:
                yield ","
            yield from encoded_pieces(item)
        yield "]"
    else:
        yield _encode_body(obj)


async def whole_answer(formatter: Formatter) -> Response:
    """The whole (non-streamed) answer; a big one (logprob tables: 50 MB with prompt_logprobs=20, n=16 and a
    2,000-token prompt) built and encoded on a worker thread, in pieces, so the event loop keeps serving."""
    if formatter.size_hint() < OFF_LOOP_VALUES:
        return JSONResponse(formatter.body())
    body = await asyncio.to_thread(lambda: "".join(encoded_pieces(formatter.body())).encode())
    return Response(body, media_type="application/json")


@dataclass
class ChoiceTotal:
    """A choice gathered whole (non-streaming responses, and the usage of streams)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptRows | None = None  # when the request asked for them (its first delta has them)

    def add(self, delta: ChoiceDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


class Formatter:
    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, response_id: str, model: str, tokenization: Tokenization, prompts: list[Prompt], n: int, *,
                 num_logprobs: int | None, return_token_ids: bool, include_usage: bool,
                 continuous_usage: bool = False, num_prompt_logprobs: int | None = None) -> None:
        self.id = f"{self.id_prefix}{response_id}"
        self.created = int(time.time())
        self.model = model
        self.tokenization = tokenization
        self.prompts = prompts
        self.n = n
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs  # the prompt_logprobs field, when asked
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.totals = [ChoiceTotal() for _ in range(len(prompts) * n)]
        self._started: set[int] = set()  # choices that streamed their first chunk

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    def usage(self) -> dict[str, Any]:
        """Token counts; a prompt counts once however many choices (n) it has, and so do its tokens
        served from the engine's prefix cache (prompt_tokens_details.cached_tokens, as OpenAI reports)."""
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_completion = sum(len(t.token_ids) for t in self.totals)
        num_cached = sum(max(t.num_cached_tokens for t in self.totals[i * self.n:(i + 1) * self.n])
                         for i in range(len(self.prompts)))
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion, "prompt_tokens_details": {"cached_tokens": num_cached}}

    def size_hint(self) -> int:
        """About how many values the whole answer holds: each token's, and its logprob tables'."""
        generated = sum(len(total.token_ids) for total in self.totals) * (1 + (self.num_logprobs or 0))
        num_tabled = sum(len(self.prompt_of(index).token_ids) for index, total in enumerate(self.totals)
                         if total.prompt_logprobs is not None)
        return generated + num_tabled * (1 + max(self.num_prompt_logprobs or 0, self.num_logprobs or 0))

    def _envelope(self, choices: list[dict], obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        """The stream chunk of a delta; None when it shows the client nothing (tokens that do not
        complete a character yet, with neither token ids nor logprobs asked for)."""
        offset = len(self.totals[delta.index].text)
        self.totals[delta.index].add(delta)
        if not (delta.text or delta.finish_reason or self.return_token_ids or self.num_logprobs is not None):
            return None
        first = delta.index not in self._started
        self._started.add(delta.index)
        body = self._envelope([self._chunk_choice(delta, first, offset)], self.chunk_object_name)
        if self.include_usage:
            body["usage"] = self.usage() if self.continuous_usage else None
        return body

    def chunks(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The stream chunks of a delta: its chunk, or none (AutoToolCallFormatter may send several)."""
        chunk = self.chunk(delta)
        return [] if chunk is None else [chunk]

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope([], self.chunk_object_name), "usage": self.usage()}

    def body(self) -> dict[str, Any]:
        choices = [self._body_choice(index, total) for index, total in enumerate(self.totals)]
        return {**self._envelope(choices, self.object_name), "usage": self.usage()}

    def _chunk_choice(self, delta: ChoiceDelta, first: bool, offset: int) -> dict[str, Any]:
        raise NotImplementedError

    def _body_choice(self, index: int, total: ChoiceTotal) -> dict[str, Any]:
        raise NotImplementedError

    def _top(self, logprobs: dict[int, float]) -> list[tuple[int, float]]:
        ranked = sorted(logprobs.items(), key=lambda item: -item[1])
        return ranked[:self.num_logprobs or 0]

    def _prompt_logprobs(self, token_ids: list[int], rows: PromptRows) -> list[dict[str, dict] | None]:
        """vLLM's prompt_logprobs: [None, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...], each
        position's prompt token and the top num_prompt_logprobs."""
        result: list[dict[str, dict] | None] = [None]
        for token_id, entry in zip(token_ids[1:], rows[1:]):
            top = _prompt_top(entry, token_id, self.num_prompt_logprobs or 0)
            result.append({str(k): {"logprob": _logprob(logprob), "rank": rank,
                                    "decoded_token": self.tokenization.token_text(k)}
                           for k, (logprob, rank) in top.items()})
        return result


def _logprob(value: float | None) -> float | None:
    return None if value is None else max(float(value), MIN_LOGPROB)


def _prompt_top(entry: PositionLogprobs, token_id: int, num: int) -> PositionLogprobs:
    """One prompt position's prompt token (first) and the top `num` of the engine's top-N (ranks 1..num)."""
    top = {token_id: entry[token_id]}
    top.update((k, value) for k, value in entry.items() if value[1] <= num and k != token_id)
    return top


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, *args: Any, echo: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._prompt_spans: dict[int, int] = {}  # prompt index -> characters of its token strings (echo offsets)

    def _echo_text(self, index: int) -> str:
        """The prompt as sent, or a token prompt as decoded with its special tokens (as vLLM echoes it): the
        echo's text_offsets count each token's text, special ones too."""
        prompt = self.prompt_of(index)
        if prompt.text is not None:
            return prompt.text
        return self.tokenization.decode(prompt.token_ids, skip_special_tokens=False)

    def _choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
                finish_reason: str | None, stop_reason: Any, offset: int, with_prompt: bool) -> dict[str, Any]:
        """with_prompt: the whole choice, or its first chunk (which carries what belongs to the prompt)."""
        choice = {"index": index, "text": text,
                  "logprobs": self._choice_logprobs(index, token_ids, logprobs, offset, with_prompt),
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        if self.num_prompt_logprobs is not None and with_prompt:
            choice["prompt_logprobs"] = self._prompt_logprobs(self.prompt_of(index).token_ids,
                                                              self.totals[index].prompt_logprobs)
        if self.return_token_ids:
            if with_prompt:
                choice["prompt_token_ids"] = self.prompt_of(index).token_ids
            choice["token_ids"] = token_ids
        return choice

    def _chunk_choice(self, delta: ChoiceDelta, first: bool, offset: int) -> dict[str, Any]:
        text = (self._echo_text(delta.index) if self.echo and first else "") + delta.text
        return self._choice(delta.index, text, delta.token_ids, delta.logprobs, delta.finish_reason,
                            delta.stop_reason, offset, first)

    def _body_choice(self, index: int, total: ChoiceTotal) -> dict[str, Any]:
        text = (self._echo_text(index) if self.echo else "") + total.text
        return self._choice(index, text, total.token_ids, total.logprobs, total.finish_reason,
                            total.stop_reason, 0, True)

    def _choice_logprobs(self, index: int, token_ids: list[int], logprobs: list[dict[int, float]], offset: int,
                         with_prompt: bool) -> dict[str, list] | None:
        """Completions' logprobs of the generated tokens; with echo, the prompt's tokens before them (in the
        first chunk of a stream), text_offset running on from the prompt's."""
        if self.num_logprobs is None:
            return None
        if not self.echo:
            return self._logprobs(token_ids, logprobs, offset)
        prompt_part = self._echo_logprobs(index) if with_prompt else None
        generated = self._logprobs(token_ids, logprobs, self._prompt_spans[index // self.n] + offset)
        if prompt_part is None:
            return generated
        return {key: prompt_part[key] + generated[key] for key in generated}

    def _echo_logprobs(self, index: int) -> dict[str, list]:
        """The prompt's tokens in logprobs' shape: the first token has no logprob (null), each other one its
        own and the top num_logprobs at its position, keyed by token string as the generated ones are."""
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token_id, entry in zip(self.prompt_of(index).token_ids, self.totals[index].prompt_logprobs):
            text = self.tokenization.token_text(token_id)
            result["tokens"].append(text)
            result["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
                continue
            result["token_logprobs"].append(_logprob(entry[token_id][0]))
            result["top_logprobs"].append({self.tokenization.token_text(k): _logprob(logprob) for k, (logprob, _)
                                           in _prompt_top(entry, token_id, self.num_logprobs or 0).items()})
        self._prompt_spans[index // self.n] = offset
        return result

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> dict[str, Any]:
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, candidates in zip(token_ids, logprobs):
            text = self.tokenization.token_text(token_id)
            result["tokens"].append(text)
            result["token_logprobs"].append(_logprob(candidates.get(token_id)))
            top = dict(self._top(candidates))
            top.setdefault(token_id, candidates.get(token_id))
            result["top_logprobs"].append({self.tokenization.token_text(k): _logprob(v) for k, v in top.items()})
            result["text_offset"].append(offset)
            offset += len(text)
        return result


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def role_chunks(self) -> list[dict[str, Any]]:
        """The first chunk of every choice: the assistant role, no content yet."""
        chunks = []
        for index in range(len(self.totals)):
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            body = self._envelope([choice], self.chunk_object_name)
            if self.return_token_ids and index == 0:
                body["prompt_token_ids"] = self.prompts[0].token_ids
            if self.include_usage:
                body["usage"] = self.usage() if self.continuous_usage else None
            chunks.append(body)
        return chunks

    def _chunk_choice(self, delta: ChoiceDelta, first: bool, offset: int) -> dict[str, Any]:
        choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                  "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice

    def _body_choice(self, index: int, total: ChoiceTotal) -> dict[str, Any]:
        choice = {"index": index, "message": {"role": "assistant", "content": total.text},
                  "logprobs": self._logprobs(total.token_ids, total.logprobs),
                  "finish_reason": total.finish_reason, "stop_reason": total.stop_reason}
        if self.return_token_ids:
            choice["token_ids"] = total.token_ids
        return choice

    def body(self) -> dict[str, Any]:
        body = super().body()
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompts[0].token_ids
        if self.num_prompt_logprobs is not None:  # one prompt: every choice has the same set
            body["prompt_logprobs"] = self._prompt_logprobs(self.prompts[0].token_ids, self.totals[0].prompt_logprobs)
        return body

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.tokenization.token_text(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        content = []
        for token_id, candidates in zip(token_ids, logprobs):
            entry = self._entry(token_id, candidates.get(token_id))
            entry["top_logprobs"] = [self._entry(k, v) for k, v in self._top(candidates)]
            content.append(entry)
        return {"content": content}


class ToolCallFormatter(ChatFormatter):
    """A chat answer whose output is tool calls: the message's content is null and its tool_calls hold the calls.
    Streamed, a named tool's call starts in the role chunk (index, id, type, name, empty arguments) and its
    arguments follow in pieces as they come; tool_choice "required"'s calls go whole in the choice's last chunk,
    once the output is complete. An output that is no complete call list (cut short) stays the content."""

    def __init__(self, *args: Any, tool_calling: ToolCalling, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_calling = tool_calling

    def role_chunks(self) -> list[dict[str, Any]]:
        chunks = super().role_chunks()
        for chunk in chunks:
            delta = {"role": "assistant", "content": None}
            if self.tool_calling.named is not None:
                header = {"id": new_call_id(), "type": "function",
                          "function": {"name": self.tool_calling.named.name, "arguments": ""}}
                delta["tool_calls"] = [{"index": 0, **header}]
            chunk["choices"][0]["delta"] = delta
        return chunks

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        if (self.tool_calling.named is None and delta.finish_reason is None and not self.return_token_ids
                and self.num_logprobs is None):  # "required": nothing to show before the whole output
            self.totals[delta.index].add(delta)
            return None
        return super().chunk(delta)

    def _chunk_choice(self, delta: ChoiceDelta, first: bool, offset: int) -> dict[str, Any]:
        choice = super()._chunk_choice(delta, first, offset)
        if self.tool_calling.named is not None:
            if delta.text:
                choice["delta"] = {"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]}
            return choice
        choice["delta"] = {}
        if delta.finish_reason is not None:  # "required": the whole output's calls
            text = self.totals[delta.index].text
            calls = self.tool_calling.calls(text)
            if calls is None:
                choice["delta"] = {"content": text}
            else:
                choice["delta"] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                choice["finish_reason"] = "tool_calls"
        return choice

    def _body_choice(self, index: int, total: ChoiceTotal) -> dict[str, Any]:
        choice = super()._body_choice(index, total)
        calls = self.tool_calling.calls(total.text)
        if calls is not None:
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            if self.tool_calling.named is None:
                choice["finish_reason"] = "tool_calls"
        return choice


class AutoToolCallFormatter(ChatFormatter):
    """tool_choice "auto": the output is free text, which the request's tool-call parser reads
    (router/hermes_tool_parser.py). The message's content is the text outside the calls (null when none is left),
    its tool_calls the calls, and finish_reason "tool_calls" when there is one (after max_tokens too, as vLLM
    answers). Streamed, the role chunk has content null, text goes out as it comes (less what the parser holds:
    a tag's possible start, whitespace that may border a call), and each call, once whole, goes as two chunks:
    index, id, type, name and arguments "", then its arguments (so a delta may make several chunks: chunks())."""

    def __init__(self, *args: Any, tool_calling: ToolCalling, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_calling = tool_calling
        self._parsers = [tool_calling.output_parser() for _ in self.totals]  # each choice's, while it streams

    def role_chunks(self) -> list[dict[str, Any]]:
        chunks = super().role_chunks()
        for chunk in chunks:  # as OpenAI's for an answer that may be calls only (and as the whole answer's null)
            chunk["choices"][0]["delta"]["content"] = None
        return chunks

    def chunks(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        self.totals[delta.index].add(delta)
        parser = self._parsers[delta.index]
        pieces = parser.feed(delta.text)
        if delta.finish_reason is not None:
            pieces += parser.finish()
        deltas = _piece_deltas(pieces)
        if not deltas and delta.finish_reason is None and not self.return_token_ids and self.num_logprobs is None:
            return []
        choices = [{"index": delta.index, "delta": piece_delta, "logprobs": None, "finish_reason": None,
                    "stop_reason": None} for piece_delta in deltas or [{}]]
        choices[0]["logprobs"] = self._logprobs(delta.token_ids, delta.logprobs)
        if self.return_token_ids:  # the delta's tokens once, in its first chunk
            for position, choice in enumerate(choices):
                choice["token_ids"] = delta.token_ids if position == 0 else []
        if delta.finish_reason is not None:
            choices[-1]["finish_reason"] = "tool_calls" if parser.num_calls else delta.finish_reason
            choices[-1]["stop_reason"] = delta.stop_reason
        return [self._stream_chunk(choice) for choice in choices]

    def _stream_chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope([choice], self.chunk_object_name)
        if self.include_usage:
            body["usage"] = self.usage() if self.continuous_usage else None
        return body

    def _body_choice(self, index: int, total: ChoiceTotal) -> dict[str, Any]:
        choice = super()._body_choice(index, total)
        parser = self.tool_calling.output_parser()
        pieces = parser.feed(total.text) + parser.finish()
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        choice["message"]["content"] = content or None
        if parser.num_calls:
            choice["message"]["tool_calls"] = [tool_call(piece.name, piece.arguments) for piece in pieces
                                               if isinstance(piece, ParsedCall)]
            choice["finish_reason"] = "tool_calls"
        return choice


def _piece_deltas(pieces: list[Piece]) -> list[dict[str, Any]]:
    """The stream deltas of a parser's pieces: the text between calls as one content delta, and each call as
    its header (index, id, type, name, arguments "") then its arguments, as OpenAI streams a call."""
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, ParsedCall):
            header = {"id": new_call_id(), "type": "function", "function": {"name": piece.name, "arguments": ""}}
            deltas.append({"tool_calls": [{"index": piece.index, **header}]})
            deltas.append({"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]})
        elif deltas and "content" in deltas[-1]:
            deltas[-1]["content"] += piece
        else:
            deltas.append({"content": piece})
    return deltas
