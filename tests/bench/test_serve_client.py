"""One `pdserve bench` request against a scripted SSE server on a real socket: where TTFT and ITLs are
taken (text chunks only, not the role chunk or the usage chunk), token counts from usage or the
tokenizer, and how each request body is written."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from pdserve.bench.serve_client import RequestShape, build_payload, send_request
from pdserve.bench.serve_datasets import SampleRequest
from pdserve.bench.serve_load import open_session
from tests.bench.loopback_app import loopback_app

GAP_S = 0.15


def event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def chat_chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return event({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


async def scripted_chat(request: web.Request) -> web.StreamResponse:
    """A role chunk at once, text after GAP_S and again after GAP_S, an empty finishing chunk, usage."""
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    for text in ("Hello", " world"):
        await asyncio.sleep(GAP_S)
        await response.write(chat_chunk(text))
    await response.write(chat_chunk(None, finish="length"))
    if body.get("stream_options"):
        await response.write(event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}))
    await response.write(b"data: [DONE]\n\n")
    return response


async def request_scripted(include_usage: bool):
    shape = RequestShape("/v1/chat/completions", "m", include_usage=include_usage)
    payload = build_payload(SampleRequest("hi", 2, 3), shape)
    async with loopback_app("POST", "/v1/chat/completions", scripted_chat) as url, \
            open_session(None, stall_timeout_s=10, max_concurrency=1) as session:
        return await send_request(session, f"{url}/v1/chat/completions", payload,
                                  input_len=2, stall_timeout_s=10, count_tokens=lambda text: len(text.split()))


def test_ttft_and_itls_are_taken_at_chunks_that_carry_text():
    result = asyncio.run(request_scripted(include_usage=True))
    assert result.success and result.error == ""
    assert result.ttft >= GAP_S  # not at the empty role chunk
    assert len(result.itls) == 1 and result.itls[0] >= GAP_S  # not at the finishing or usage chunk
    assert result.latency >= result.ttft + result.itls[0]
    assert (result.input_len, result.output_len) == (11, 3)  # the server's usage


def test_without_usage_the_tokenizer_counts_the_output():
    result = asyncio.run(request_scripted(include_usage=False))
    assert result.success
    assert (result.input_len, result.output_len) == (2, 2)  # the dataset's count; "Hello world" in 2 "tokens"


@pytest.mark.parametrize(("shape", "expected"), [
    (RequestShape("/v1/completions", "m", token_id_prompts=True, ignore_eos=True, min_tokens=True),
     {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "min_tokens": 4,
      "stream_options": {"include_usage": True}}),
    (RequestShape("/v1/completions", "m", ignore_eos=True, include_usage=False),
     {"prompt": "a b c", "max_tokens": 4, "ignore_eos": True}),
    (RequestShape("/v1/chat/completions", "m", token_id_prompts=True),
     {"messages": [{"role": "user", "content": "a b c"}], "max_completion_tokens": 4,
      "stream_options": {"include_usage": True}}),
])
def test_request_bodies_carry_what_the_server_takes(shape, expected):
    payload = build_payload(SampleRequest("a b c", 3, 4, (5, 6, 7)), shape)
    assert payload == {"model": "m", "stream": True, "temperature": 0.0, **expected}


async def request_events(events: list[bytes]):
    """One request to a server that streams `events` as they are, then [DONE]."""
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for raw in [*events, b"data: [DONE]\n\n"]:
            await response.write(raw)
        return response

    payload = build_payload(SampleRequest("hi", 2, 3), RequestShape("/v1/completions", "m"))
    async with loopback_app("POST", "/v1/completions", stream) as url, \
            open_session(None, stall_timeout_s=10, max_concurrency=1) as session:
        return await send_request(session, f"{url}/v1/completions", payload, input_len=2, stall_timeout_s=10)


TEXT = event({"choices": [{"index": 0, "text": " a", "finish_reason": "length"}]})


@pytest.mark.parametrize(("bad", "reason"), [
    (b"data: [1, 2]\n\n", "a JSON list, not an object"),
    (event({"choices": [None]}), '"choices" is not a list of objects'),
    (event({"choices": "abc"}), '"choices" is not a list of objects'),
    (event({"choices": [], "usage": {"completion_tokens": "lots"}}), "usage.completion_tokens 'lots' is not a"),
    (event({"choices": [], "usage": {"completion_tokens": 1e300}}), "usage.completion_tokens 1e+300 is not a"),
    (event({"choices": [], "usage": {"prompt_tokens": -5, "completion_tokens": 1}}), "usage.prompt_tokens -5"),
    (event({"choices": [], "usage": [3]}), "usage is a JSON list"),
])
def test_a_malformed_chunk_fails_its_request_with_a_reason_never_an_exception(bad, reason):
    result = asyncio.run(request_events([TEXT, bad]))
    assert not result.success and result.error.startswith("bad stream chunk: ") and reason in result.error


def test_text_that_is_no_string_is_no_text():
    chunks = [event({"choices": [{"index": 0, "text": 5}]}), event({"choices": [{"index": 0, "delta": "x"}]}), TEXT]
    result = asyncio.run(request_events(chunks))
    assert result.success and result.itls == [] and result.output_len == 1  # only " a" counted, as one chunk
