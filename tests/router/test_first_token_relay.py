"""The router's side of the first token from the prefill engine, against scripted engines
(tests/router/fake_engine.py): it is streamed, the decode engine is told it and its own copy is dropped,
and a decode engine lost before its first token ends the stream with an error after that token."""

from __future__ import annotations

import asyncio
import json

from pdserve.control.messages import FirstToken
from tests.router.conftest import router_app, wait_until
from tests.router.fake_engine import fake_tokens
from tests.router.test_engines_and_failures import PROMPT_IDS, _close, _engines, completion


def _events(response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_the_decode_stream_continues_from_the_second_token(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            prefill, decode = await _engines(gateway, {"role": "prefill", "engine_id": "p0", "first_token": True},
                                             {"engine_id": "d0", "token_delay_s": 0.05})
            try:
                body = completion(max_tokens=6, stream=True, return_token_ids=True)
                events = _events(await client.post("/v1/completions", json=body))
                chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
                assert [t for c in chunks for t in c["token_ids"]] == fake_tokens(PROMPT_IDS, 6)
                assert chunks[0]["token_ids"] == fake_tokens(PROMPT_IDS, 1), "the first chunk is P's token alone"
                told = [m for m in decode.received if isinstance(m, FirstToken)]
                assert [(m.request_id, m.token_id) for m in told] == [
                    (decode.generate_requests()[0].request_id, fake_tokens(PROMPT_IDS, 1)[0])]
            finally:
                _close([prefill, decode])
    asyncio.run(scenario())


def test_a_decode_engine_lost_before_its_first_token_is_an_error_after_it(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            prefill, decode = await _engines(gateway, {"role": "prefill", "engine_id": "p0", "first_token": True},
                                             {"engine_id": "d0", "token_delay_s": 60})

            async def lose_decode():
                await wait_until(lambda: any(isinstance(m, FirstToken) for m in decode.received),
                                 what="the first token relayed")
                decode.beating.clear()
                decode.answering.clear()
            losing = asyncio.create_task(lose_decode())
            try:
                body = completion(max_tokens=6, stream=True, return_token_ids=True)
                events = _events(await client.post("/v1/completions", json=body))
                await losing
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["error"]["code"] == "engine_failed"
                tokens = [t for e in events[:-2] for t in json.loads(e)["choices"][0]["token_ids"]]
                assert tokens == fake_tokens(PROMPT_IDS, 1), "the first token, then the error"
            finally:
                _close([prefill, decode])
    asyncio.run(scenario())
