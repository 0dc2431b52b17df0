"""The router's side of the first token from the prefill engine, against scripted engines
(tests/router/fake_engine.py): it is streamed, the decode engine is told it and its own copy is dropped,
a decode engine lost before its first token ends the stream with an error after that token, and both
engines get the same seed for a random choice."""

from __future__ import annotations

import asyncio
import json

from pdserve.control.messages import FirstToken, PrefillRequest
from tests.router.conftest import router_app, wait_until
from tests.router.fake_engine import fake_tokens
from tests.router.test_engines_and_failures import PROMPT_IDS, completion, serving_engines


def _events(response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


def test_the_decode_stream_continues_from_the_second_token(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"role": "prefill", "engine_id": "p0", "first_token": True},
                                       {"engine_id": "d0", "token_delay_s": 0.05}) as (prefill, decode):
                body = completion(max_tokens=6, stream=True, return_token_ids=True)
                events = _events(await client.post("/v1/completions", json=body))
                chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
                assert [t for c in chunks for t in c["token_ids"]] == fake_tokens(PROMPT_IDS, 6)
                assert chunks[0]["token_ids"] == fake_tokens(PROMPT_IDS, 1), "the first chunk is P's token alone"
                told = [m for m in decode.received if isinstance(m, FirstToken)]
                assert [(m.request_id, m.token_id) for m in told] == [
                    (decode.generate_requests()[0].request_id, fake_tokens(PROMPT_IDS, 1)[0])]
    asyncio.run(scenario())


def test_a_decode_engine_lost_before_its_first_token_is_an_error_after_it(tiny_model, tokenization):
    """No other decode engine: the stream waits --migration-timeout (0.5 s here, not the default 15 s) for one."""
    async def scenario():
        async with router_app(tiny_model, tokenization, migration_timeout_s=0.5) as (gateway, client):
            async with serving_engines(gateway, {"role": "prefill", "engine_id": "p0", "first_token": True},
                                       {"engine_id": "d0", "token_delay_s": 60}) as (prefill, decode):

                async def lose_decode():
                    await wait_until(lambda: any(isinstance(m, FirstToken) for m in decode.received),
                                     what="the first token relayed")
                    decode.beating.clear()
                    decode.answering.clear()
                losing = asyncio.create_task(lose_decode())
                body = completion(max_tokens=6, stream=True, return_token_ids=True)
                events = _events(await client.post("/v1/completions", json=body))
                await losing
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["error"]["code"] == "engine_failed"
                tokens = [t for e in events[:-2] for t in json.loads(e)["choices"][0]["token_ids"]]
                assert tokens == fake_tokens(PROMPT_IDS, 1), "the first token, then the error"
    asyncio.run(scenario())


def test_both_engines_get_one_seed_for_an_unseeded_random_choice(tiny_model, tokenization):
    """A decode engine that samples the first token itself (it prefills locally) must draw the prefill
    engine's token: an unseeded random choice gets one random seed for both; greedy and seeded stay as sent."""
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"role": "prefill", "engine_id": "p0", "first_token": True},
                                       {"engine_id": "d0", "token_delay_s": 0.01}) as (prefill, decode):
                for extra in ({"temperature": 1.0}, {"temperature": 1.0}, {"temperature": 0}, {"seed": 5}):
                    response = await client.post("/v1/completions", json={**completion(max_tokens=3), **extra})
                    assert response.status_code == 200, response.text
                sent = [(p.sampling_params.seed, d.sampling_params.seed)
                        for p, d in zip((m for m in prefill.received if isinstance(m, PrefillRequest)),
                                        decode.generate_requests())]
                (p1, d1), (p2, d2), greedy, seeded = sent
                assert p1 == d1 is not None and p2 == d2 is not None and p1 != p2, sent
                assert greedy == (None, None) and seeded == (5, 5)
    asyncio.run(scenario())
