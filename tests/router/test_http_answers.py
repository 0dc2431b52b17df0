"""What the generation endpoints answer (router/api.py, routes of router/body_route.py's BodyRoute):
status, content type and error, for good requests (whole and streamed) and every kind of refusal (body
cap by Content-Length and by a chunked body, API key, bad JSON and fields, unknown model, no engine),
and an unexpected server error."""

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

# (path, body bytes or JSON, headers) -> (status with an engine, without one, the error's code or param)
CASES = [
    (("/v1/completions", COMPLETION, KEY), 200, 503, None),
    (("/v1/completions", {**COMPLETION, "stream": True}, KEY), 200, 503, None),
    (("/v1/chat/completions", CHAT, KEY), 200, 503, None),
    (("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, KEY), 200, 503,
     None),
    (("/v1/completions", COMPLETION, {}), 401, 401, "invalid_api_key"),
    (("/v1/completions", COMPLETION, {"authorization": "Bearer wrong"}), 401, 401, "invalid_api_key"),
    (("/v1/completions", b'{"prompt": [1, 2', {**KEY, "content-type": "application/json"}), 400, 400,
     "not valid JSON"),
    (("/v1/completions", {"prompt": 5, "max_tokens": "many"}, KEY), 400, 400, "max_tokens"),
    (("/v1/completions", {**COMPLETION, "model": "another-model"}, KEY), 404, 404, "model_not_found"),
    (("/v1/completions", {**COMPLETION, "max_tokens": 10**6}, KEY), 400, 503, "max_tokens"),
    (("/v1/chat/completions", {"messages": "not a list"}, KEY), 400, 400, "messages"),
    (("/v1/completions", b"x" * (MAX_BYTES + 1), {**KEY, "content-type": "application/json"}), 413, 413,
     "request_too_large"),
]


def _comparable(text: str) -> str:
    """The body less what differs between any two requests or routers (ids, timestamps, ports)."""
    text = re.sub(r'"(id|system_fingerprint)":"[^"]*"', r'"\1":"*"', text)
    text = re.sub(r"tcp://[0-9.]+:[0-9]+", "tcp://*", text)  # each router's registration address
    return re.sub(r'"created":\d+', '"created":0', text)


async def _answers(model_dir: str, tokenization, with_engine: bool) -> list[tuple]:
    async with router_app(model_dir, tokenization, api_key="sesame",
                          max_request_bytes=MAX_BYTES) as (gateway, client):
        engine = None
        if with_engine:
            engine = FakeEngine(router_address=gateway.registry.registration_address)
            await wait_until(lambda: any(link.up for link in gateway.registry.links.values()), what="engine up")
        try:
            answers = []
            for (path, body, headers), *_ in CASES:
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
def test_each_request_gets_its_answer(tiny_model, tokenization, with_engine):
    answers = asyncio.run(_answers(tiny_model, tokenization, with_engine))
    for answer, (_, with_status, without_status, what) in zip(answers, CASES):
        path, status, content_type, _, text = answer
        assert status == (with_status if with_engine else without_status), answer
        if status == 200:
            continue
        assert content_type == "application/json", answer
        error = json.loads(text)["error"]
        if status == 503:
            assert error["code"] == "no_engine_available", answer
        else:
            assert what in (error["code"], error["param"]) or what in error["message"], answer
    if with_engine:  # the streamed answers' headers and events (router/streaming.py writes them)
        for _, status, content_type, _, text in answers[1:4:2]:
            assert content_type == "text/event-stream; charset=utf-8" and text.endswith("data: [DONE]\n\n"), text
    assert answers[-1][:2] == ("chunked", 413) and "request_too_large" in answers[-1][2], answers[-1]


def test_an_unexpected_error_is_a_500_in_openai_shape(tiny_model, tokenization, monkeypatch):
    from pdserve.router import api

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "completion_specs", broken)

    async def scenario():
        # the stack re-raises after its 500 (for the server's log): the client sees the 500
        async with started_router(tiny_model, tokenization) as (gateway, app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                  base_url="http://router") as client:
            engine = FakeEngine(router_address=gateway.registry.registration_address)
            try:
                await wait_until(lambda: any(link.up for link in gateway.registry.links.values()), what="engine up")
                response = await client.post("/v1/completions", json=COMPLETION)
                return response.status_code, response.json()
            finally:
                engine.close()

    status, body = asyncio.run(scenario())
    assert status == 500 and "RuntimeError: a bug" in body["error"]["message"], body
