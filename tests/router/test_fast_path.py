"""The generation endpoints answer the same through the fast path (router/fast_path.py) as through
FastAPI's routes and middleware: status, headers that matter and body, for good requests (whole and
streamed), every kind of refusal the layers it skips gave (body cap by Content-Length and by a chunked
body, API key, bad JSON and fields, unknown model, no engine), and an unexpected server error."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from tests.router.conftest import router_app, started_router, wait_until
from tests.router.fake_engine import FakeEngine

KEY = {"authorization": "Bearer sesame"}
COMPLETION = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
MAX_BYTES = 4096

# (path, body bytes or JSON, headers): one row per kind of answer
CASES = [
    ("/v1/completions", COMPLETION, KEY),
    ("/v1/completions", {**COMPLETION, "stream": True}, KEY),
    ("/v1/chat/completions", CHAT, KEY),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, KEY),
    ("/v1/completions", COMPLETION, {}),
    ("/v1/completions", COMPLETION, {"authorization": "Bearer wrong"}),
    ("/v1/completions", b'{"prompt": [1, 2', {**KEY, "content-type": "application/json"}),
    ("/v1/completions", {"prompt": 5, "max_tokens": "many"}, KEY),
    ("/v1/completions", {**COMPLETION, "model": "another-model"}, KEY),
    ("/v1/completions", {**COMPLETION, "max_tokens": 10**6}, KEY),
    ("/v1/chat/completions", {"messages": "not a list"}, KEY),
    ("/v1/completions", b"x" * (MAX_BYTES + 1), {**KEY, "content-type": "application/json"}),
]


def _comparable(text: str) -> str:
    """The body less what differs between any two requests or routers (ids, timestamps, ports)."""
    text = re.sub(r'"(id|system_fingerprint)":"[^"]*"', r'"\1":"*"', text)
    text = re.sub(r"tcp://[0-9.]+:[0-9]+", "tcp://*", text)  # each router's registration address
    return re.sub(r'"created":\d+', '"created":0', text)


async def _answers(model_dir: str, tokenization, fast_path: bool, with_engine: bool) -> list[tuple]:
    async with router_app(model_dir, tokenization, fast_path=fast_path, api_key="sesame",
                          max_request_bytes=MAX_BYTES) as (gateway, client):
        engine = None
        if with_engine:
            engine = FakeEngine(router_address=gateway.registry.registration_address)
            await wait_until(lambda: any(link.up for link in gateway.registry.links.values()), what="engine up")
        try:
            answers = []
            for path, body, headers in CASES:
                if not isinstance(body, bytes):
                    body, headers = json.dumps(body).encode(), {**headers, "content-type": "application/json"}
                response = await client.post(path, content=body, headers=headers)
                answers.append((path, response.status_code, response.headers.get("content-type"),
                                response.headers.get("www-authenticate"), _comparable(response.text)))
            chunked = await client.post("/v1/completions", content=_chunks(b"y" * (MAX_BYTES + 10)), headers=KEY)
            answers.append(("chunked", chunked.status_code, chunked.text))
            return answers
        finally:
            if engine is not None:
                engine.close()


async def _chunks(data: bytes):
    for start in range(0, len(data), 1000):
        yield data[start:start + 1000]


@pytest.mark.parametrize("with_engine", [True, False], ids=["engine", "no-engine"])
def test_fast_path_answers_as_fastapi_does(tiny_model, tokenization, with_engine):
    fast = asyncio.run(_answers(tiny_model, tokenization, True, with_engine))
    full = asyncio.run(_answers(tiny_model, tokenization, False, with_engine))
    for fast_answer, full_answer in zip(fast, full, strict=True):
        assert fast_answer == full_answer
    statuses = {answer[1] for answer in fast}
    assert statuses >= ({200, 400, 401, 404, 413} if with_engine else {503, 401, 413})
    if with_engine:  # the streamed answer's headers (router/streaming.py writes them once, as Starlette would)
        assert fast[1][2] == "text/event-stream; charset=utf-8"


def test_an_unexpected_error_is_a_500_in_openai_shape(tiny_model, tokenization, monkeypatch):
    from pdserve.router import api

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "completion_specs", broken)

    async def scenario(fast_path: bool):
        # the full stack re-raises after its 500 (for the server's log): the client sees the 500 either way
        async with started_router(tiny_model, tokenization, fast_path=fast_path) as (gateway, app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                  base_url="http://router") as client:
            engine = FakeEngine(router_address=gateway.registry.registration_address)
            try:
                await wait_until(lambda: any(link.up for link in gateway.registry.links.values()), what="engine up")
                response = await client.post("/v1/completions", json=COMPLETION)
                return response.status_code, response.json()
            finally:
                engine.close()

    fast, full = asyncio.run(scenario(True)), asyncio.run(scenario(False))
    assert fast == full
    assert fast[0] == 500 and "RuntimeError: a bug" in fast[1]["error"]["message"]
