"""The router routes by its own ledger of what it has open on each engine (router.policies), over real ZeroMQ
against scripted engines whose heartbeats lag, as a real engine's do during a long step."""

from __future__ import annotations

import asyncio

from tests.router.conftest import router_app, wait_until
from tests.router.fake_engine import FakeEngine

LONG_PROMPT = list(range(1, 401))
FAST_BEATS = {"heartbeat_interval_s": 0.05, "token_delay_s": 0.05}


async def _two_engines(gateway) -> list[FakeEngine]:
    engines = [FakeEngine(router_address=gateway.registry.registration_address, engine_id=f"d{i}", **FAST_BEATS)
               for i in range(2)]
    await wait_until(lambda: sum(link.up for link in gateway.registry.links.values()) == 2, what="engines in routing")
    return engines


def test_least_kv_routes_by_what_is_open_on_each_engine_not_by_lagging_reports(tiny_model, tokenization):
    """One engine streams a 400-token prompt's answer while its heartbeat repeats a report from before the prompt
    (0 blocks); the other is idle, but its report still counts requests that have ended (60 of 100 blocks). A new
    prompt goes to the idle one, and the ledger is back to zero once every request has ended."""
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            engines = await _two_engines(gateway)
            try:
                long_request = asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": LONG_PROMPT, "max_tokens": 40, "temperature": 0}))
                await wait_until(lambda: any(engine.active for engine in engines), what="the long request streaming")
                busy = next(engine for engine in engines if engine.generate_requests())
                idle = next(engine for engine in engines if engine is not busy)
                busy.reported, idle.reported = {"kv_blocks_used": 0}, {"kv_blocks_used": 60}
                links = {link.control_address: link for link in gateway.registry.links.values()}
                busy_link, idle_link = links[busy.control_address], links[idle.control_address]
                await wait_until(lambda: (busy_link.stats.kv_blocks_used, idle_link.stats.kv_blocks_used) == (0, 60),
                                 what="the lagging reports taken in")
                await wait_until(lambda: busy_link.open_tokens > len(LONG_PROMPT),  # the prompt and a streamed token
                                 what="the long answer's first tokens in the ledger")
                short = await client.post("/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 2})
                assert short.status_code == 200, short.text
                assert len(idle.generate_requests()) == 1 and len(busy.generate_requests()) == 1
                assert (await long_request).status_code == 200
                assert all(link.open_tokens == 0 and not link.stream_tokens for link in links.values())
            finally:
                for engine in engines:
                    engine.close()
    asyncio.run(scenario())


def test_a_prompt_counts_on_its_prefill_engine_until_its_first_token(tiny_model, tokenization):
    """Prefill side: a prompt sent to a prefill engine is its load until the prompt's first token flows, whatever
    its heartbeat says meanwhile (here: nothing queued, while the other prefill engine's lagging report says 300
    tokens). The next prompt goes to the other prefill engine, and both ledgers end at zero."""
    async def scenario():
        async with router_app(tiny_model, tokenization, prefill_policy="least_loaded") as (gateway, client):
            registration = gateway.registry.registration_address
            prefills = [FakeEngine(role="prefill", engine_id=f"p{i}", router_address=registration, **FAST_BEATS)
                        for i in range(2)]
            decode = FakeEngine(engine_id="d", router_address=registration, heartbeat_interval_s=0.05,
                                token_delay_s=0.5)
            engines = [*prefills, decode]
            try:
                await wait_until(lambda: sum(link.up for link in gateway.registry.links.values()) == 3,
                                 what="engines in routing")
                links = {link.control_address: link for link in gateway.registry.links.values()}
                first = asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}))
                await wait_until(lambda: any(engine.received for engine in prefills), what="the first prompt sent")
                busy = next(engine for engine in prefills if engine.received)
                other = next(engine for engine in prefills if engine is not busy)
                busy.reported, other.reported = {"queued_prefill_tokens": 0}, {"queued_prefill_tokens": 300}
                await wait_until(lambda: links[other.control_address].stats.queued_prefill_tokens == 300,
                                 what="the lagging report taken in")
                assert links[busy.control_address].open_tokens == len(LONG_PROMPT)
                second = asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": [7, 8, 9] * 10, "max_tokens": 2, "temperature": 0}))
                await wait_until(lambda: len(busy.received) + len(other.received) == 2, what="the second prompt sent")
                assert len(other.received) == 1
                assert [response.status_code for response in await asyncio.gather(first, second)] == [200, 200]
                assert all(link.open_tokens == 0 and not link.stream_tokens for link in links.values())
            finally:
                for engine in engines:
                    engine.close()
    asyncio.run(scenario())
