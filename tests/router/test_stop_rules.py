"""vLLM (v1)'s stop rules in the router, against scripted engines (tests/router/fake_engine.py), streamed and
whole, with the first token from the prefill engine: no stop string matches within min_tokens, a stop
string stays in the text with include_stop_str_in_output, and the engine's stop token shows no text.
The fake engines' tokens from PROMPT_IDS are one character each: & ' ( ) * + , - . / 0 1 ..."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.router.conftest import router_app
from tests.router.fake_engine import fake_tokens
from tests.router.test_engines_and_failures import PROMPT_IDS, completion, serving_engines

PREFILL = {"role": "prefill", "engine_id": "p0", "first_token": True}


def answer(tiny_model, tokenization, engine_specs: list[dict], body: dict, path: str = "/v1/completions") -> dict:
    """{"text", "token_ids", "finish_reason", "stop_reason"} of one choice, gathered from the stream
    (which must agree with the whole response, asked for too)."""
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, *engine_specs):
                whole = (await client.post(path, json={**body, "return_token_ids": True})).json()
                streamed = await client.post(path, json={**body, "return_token_ids": True, "stream": True})
                return whole, [json.loads(line[6:]) for line in streamed.text.splitlines()
                               if line.startswith("data: {")]
    whole, chunks = asyncio.run(scenario())
    choice, choices = whole["choices"][0], [chunk["choices"][0] for chunk in chunks]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    pieces = [c["delta"].get("content", "") if "delta" in c else c["text"] for c in choices]
    assert "".join(pieces) == text, "streamed and whole agree"
    assert [t for c in choices for t in c.get("token_ids") or []] == choice["token_ids"]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == [choice["finish_reason"]]
    assert whole["usage"]["completion_tokens"] == len(choice["token_ids"])
    return {"text": text, "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"],
            "stop_reason": choice["stop_reason"]}


@pytest.mark.parametrize("engines", [[{"engine_id": "d0"}], [PREFILL, {"engine_id": "d0"}]],
                         ids=["colocated", "first token from the prefill engine"])
def test_stop_strings_are_looked_for_only_past_min_tokens(tiny_model, tokenization, engines):
    tokens = fake_tokens(PROMPT_IDS, 8)  # & ' ( ) * + , -
    got = answer(tiny_model, tokenization, engines, completion(max_tokens=8, min_tokens=2, stop=["&", "'", ")"]))
    assert (got["text"], got["stop_reason"], got["finish_reason"]) == ("&'(", ")", "stop"), got
    assert got["token_ids"] == tokens[:4]
    # a match that ends past min_tokens counts, though it starts within them (across P's token and D's)
    got = answer(tiny_model, tokenization, engines, completion(max_tokens=8, min_tokens=1, stop=["&'"]))
    assert (got["text"], got["stop_reason"], got["token_ids"]) == ("", "&'", tokens[:2]), got


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_model, tokenization):
    got = answer(tiny_model, tokenization, [PREFILL, {"engine_id": "d0"}],
                 completion(max_tokens=8, stop=[")"], include_stop_str_in_output=True))
    assert (got["text"], got["stop_reason"], got["token_ids"]) == ("&'()", ")", fake_tokens(PROMPT_IDS, 4)), got


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_stop_tokens_text_is_left_out(tiny_model, tokenization, include, path):
    script = fake_tokens(PROMPT_IDS, 4)  # & ' ( ), the last the stop token that ends the engine's request
    body = completion(max_tokens=8, include_stop_str_in_output=include)
    if path.endswith("chat/completions"):
        body = {**body, "messages": [{"role": "user", "content": "hi"}]}
        del body["prompt"]
    got = answer(tiny_model, tokenization, [{"engine_id": "d0", "script": script}], body, path)
    assert got["text"] == ("&'()" if include else "&'(") and got["token_ids"] == script, got
    assert got["finish_reason"] == "stop"
