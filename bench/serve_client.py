"""One streamed request to an OpenAI-compatible server -> a RequestResult (timings, token counts, or why
it failed). Never raises: an HTTP error, a dropped connection, a stall or a broken stream is a reason.

TTFT is taken at the first chunk that carries text, each ITL between consecutive such chunks (a chunk
may hold several tokens), as vLLM bench serve does. Token counts come from the server's usage
(stream_options.include_usage); without one, output tokens are the tokenizer's count of the text (or
the number of text chunks when there is no tokenizer).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from pdserve.bench.serve_datasets import SampleRequest
from pdserve.bench.serve_metrics import RequestResult

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
MAX_ERROR_BYTES = 4096


@dataclass(frozen=True)
class RequestShape:
    """How every request of a run is written (what the server was found to accept)."""

    endpoint: str
    model: str
    token_id_prompts: bool = False  # the prompt as token ids (completions only)
    ignore_eos: bool = False
    min_tokens: bool = False  # min_tokens = max_tokens too, with ignore_eos
    include_usage: bool = True


def build_payload(sample: SampleRequest, shape: RequestShape) -> dict:
    body: dict = {"model": shape.model, "stream": True, "temperature": 0.0}
    if shape.include_usage:
        body["stream_options"] = {"include_usage": True}
    if shape.endpoint == CHAT_ENDPOINT:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.output_len
    else:
        use_ids = shape.token_id_prompts and sample.prompt_token_ids is not None
        body["prompt"] = list(sample.prompt_token_ids) if use_ids else sample.prompt
        body["max_tokens"] = sample.output_len
    if shape.ignore_eos:
        body["ignore_eos"] = True
        if shape.min_tokens:
            body["min_tokens"] = sample.output_len
    return body


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        text = choice["text"]
    else:
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text if isinstance(text, str) else ""


def _usage_problem(usage) -> str:
    """Why a usage object cannot be counted ('' when it can): its token counts must be whole numbers >= 0."""
    if not isinstance(usage, dict):
        return f"usage is a JSON {type(usage).__name__}, not an object"
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"usage.{key} {value!r} is not a token count"
    return ""


async def error_message(response: aiohttp.ClientResponse) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text."""
    raw = await response.content.read(MAX_ERROR_BYTES)
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return " ".join(text.split())[:300] or response.reason or ""
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message", body)))
        message = error.get("message", error) if isinstance(error, dict) else error
        return " ".join(str(message).split())[:300]
    return " ".join(text.split())[:300]


class _Stream:
    """What a stream showed so far: text-chunk times, text, usage, and whether it ended properly."""

    def __init__(self, start: float, keep_text: bool) -> None:
        self.start = start
        self.keep_text = keep_text
        self.ttft: float | None = None
        self.last = start
        self.itls: list[float] = []
        self.texts: list[str] = []
        self.num_text_chunks = 0
        self.usage: dict | None = None
        self.finished = False
        self.error = ""

    def add(self, chunk, now: float) -> None:
        if not isinstance(chunk, dict):
            self.error = f"bad stream chunk: a JSON {type(chunk).__name__}, not an object"
            return
        if "error" in chunk:
            error = chunk["error"]
            self.error = "stream error: " + str(error.get("message", error) if isinstance(error, dict) else error)
            return
        if chunk.get("usage"):
            problem = _usage_problem(chunk["usage"])
            if problem:
                self.error = f"bad stream chunk: {problem}"
                return
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not choices:
            return
        if not isinstance(choices, list) or not isinstance(choices[0], dict):
            self.error = "bad stream chunk: \"choices\" is not a list of objects"
            return
        text = _choice_text(choices[0])
        if text:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itls.append(now - self.last)
            self.last = now
            self.num_text_chunks += 1
            if self.keep_text:
                self.texts.append(text)
        if choices[0].get("finish_reason"):
            self.finished = True


async def _read_stream(response: aiohttp.ClientResponse, stream: _Stream) -> bool:
    """Feed the SSE events to `stream`; whether [DONE] came. Reads whatever bytes have arrived and splits
    them into lines itself (one await per read, not per line); events that arrived together share a time."""
    pending = b""
    async for piece in response.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == b"[DONE]":
                return True
            stream.add(json.loads(data), now)
            if stream.error:
                return False
    return False


def _finish(result: RequestResult, stream: _Stream, end: float, count_tokens: Callable[[str], int] | None) -> None:
    result.latency = end - stream.start
    result.ttft = stream.ttft if stream.ttft is not None else result.latency
    result.itls = stream.itls
    usage = stream.usage or {}
    if usage.get("completion_tokens") is not None:
        result.output_len = int(usage["completion_tokens"])
    elif count_tokens is not None:
        result.output_len = count_tokens("".join(stream.texts))
    else:
        result.output_len = stream.num_text_chunks
    if usage.get("prompt_tokens") is not None:
        result.input_len = int(usage["prompt_tokens"])
    result.success = True


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, *, input_len: int | None,
                       stall_timeout_s: float, count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """POST one streaming request and time it. The session's read timeout is the stall limit."""
    result = RequestResult(input_len=input_len or 0)
    result.start = time.perf_counter()
    stream = _Stream(result.start, keep_text=count_tokens is not None)
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {await error_message(response)}"
                return result
            done = await _read_stream(response, stream)
    except TimeoutError:
        result.error = f"stalled: no data for {stall_timeout_s:g} s (--request-timeout)"
    except aiohttp.ClientConnectorError as exc:
        result.error = f"cannot connect: {exc}"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        result.error = f"connection dropped: {exc or type(exc).__name__}"
    except json.JSONDecodeError as exc:
        result.error = f"bad stream chunk: not JSON ({exc.msg})"
    except Exception as exc:  # noqa: BLE001 - a request's failure is a reason in the results, never a crash
        result.error = f"{type(exc).__name__}: {exc}"
    else:
        if stream.error:
            result.error = stream.error
        elif not (done or stream.finished):
            result.error = "stream ended early: no finish_reason and no [DONE]"
        else:
            _finish(result, stream, time.perf_counter(), count_tokens)
    return result
