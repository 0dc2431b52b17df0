"""docs/serving/api.md's claims about request fields, checked as a vLLM user meets them (found by probing a running
`pdserve up` against the doc): a refusal's `param` names the field even when the whole body's validator refuses
it, null inside stream_options means its default, and vLLM's continuous_usage_stats alone is not ignored."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.router.conftest import assert_openai_error, router_app, wait_until
from tests.router.fake_engine import FakeEngine

MESSAGES = [{"role": "user", "content": "hi"}]


def run(coro):
    return asyncio.run(coro)


def test_refusals_of_the_whole_body_name_their_field(tiny_model, tokenization):
    """Fields refused by a validator of the whole body (chat's echo, guided_whitespace_pattern, text that is not
    valid Unicode) had `param: null`; docs/serving/api.md promises the field in `param`."""
    cases = [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "echo": true}', "echo"),
        ("/v1/completions", b'{"prompt": "hi", "guided_whitespace_pattern": " "}', "guided_whitespace_pattern"),
        ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ]

    async def scenario():
        async with router_app(tiny_model, tokenization) as (_, client):
            for path, body, param in cases:
                response = await client.post(path, content=body, headers={"content-type": "application/json"})
                error = assert_openai_error(response, 400, type_="invalid_request_error")
                assert error["param"] == param, error
                assert param in error["message"], error

    run(scenario())


def _stream_usages(lines: list[str]) -> list:
    """Each data chunk's usage (absent: "-"), [DONE] left out."""
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    return [chunk.get("usage", "-") for chunk in chunks]


@pytest.mark.parametrize("options, expected", [
    # vLLM's include_usage defaults to true: continuous_usage_stats alone puts the usage in every chunk
    ({"continuous_usage_stats": True}, "every"),
    ({"include_usage": None, "continuous_usage_stats": True}, "every"),  # null: as if not sent
    ({"include_usage": False, "continuous_usage_stats": True}, "none"),  # said no: no usage
    ({"include_usage": True, "continuous_usage_stats": None}, "last"),
    ({"include_usage": None}, "none"),  # OpenAI's default
])
def test_stream_options_nulls_and_continuous_usage_alone(tiny_model, tokenization, options, expected):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            engine = FakeEngine(router_address=gateway.registry.registration_address, token_delay_s=0.001)
            try:
                await wait_until(lambda: gateway.registry.engines("decode"), what="engine in routing")
                for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions",
                                                                                      {"prompt": [5, 6, 7]})):
                    response = await client.post(path, json={**body, "max_tokens": 3, "stream": True,
                                                             "stream_options": options})
                    assert response.status_code == 200, response.text
                    usages = _stream_usages(response.text.splitlines())
                    if expected == "none":
                        assert set(map(str, usages)) == {"-"}, usages
                        continue
                    *during, last = usages
                    assert last["completion_tokens"] == 3, usages
                    if expected == "every":
                        counts = [usage["completion_tokens"] for usage in during]
                        assert counts == sorted(counts) and counts[-1] == 3, usages
                    else:
                        assert during == [None] * len(during), usages
            finally:
                engine.close()

    run(scenario())
