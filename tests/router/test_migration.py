"""Migration through the real router and real ZeroMQ, with scripted engines (tests/router/fake_engine.py): a
decode engine that stops beating mid-stream hands its stream to another, which is sent the tokens the client
has as resume_token_ids; the stream goes on with no token lost or repeated, and the counter moves."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.control.messages import GenerateRequest
from tests.router.conftest import router_app, wait_until
from tests.router.fake_engine import FakeEngine, fake_tokens

PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
MAX_TOKENS = 20


async def _engines(gateway, *engine_ids: str) -> list[FakeEngine]:
    engines = [FakeEngine(router_address=gateway.registry.registration_address, engine_id=engine_id,
                          token_delay_s=0.05) for engine_id in engine_ids]
    await wait_until(lambda: len(gateway.registry.engines("decode")) == len(engines), what="engines in routing")
    return engines


def _stream_events(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("stream", [True, False])
def test_a_stream_whose_engine_stops_beating_goes_on_on_another_engine(tiny_model, tokenization, stream):
    """Streamed, the client's stream goes on; whole, the answer is gathered across the move (not restarted)."""
    async def scenario():
        async with router_app(tiny_model, tokenization, heartbeat_timeout_s=0.5) as (gateway, client):
            engines = await _engines(gateway, "d0", "d1")

            async def silence_the_one_streaming() -> FakeEngine:
                await wait_until(lambda: any(a.sent >= 3 for e in engines for a in e.active.values()),
                                 what="tokens streamed")
                lost = next(e for e in engines if e.active)
                lost.beating.clear()
                lost.answering.clear()
                return lost
            silencer = asyncio.create_task(silence_the_one_streaming())
            try:
                body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
                        "return_token_ids": True}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                response = await client.post("/v1/completions", json=body)
                lost = await silencer
                events = _stream_events(response.text) if stream else [response.json()]
                assert all("error" not in event for event in events), events
                survivor, = [e for e in engines if e is not lost]
                resumed, = [m for m in survivor.received if isinstance(m, GenerateRequest)]
                expected = fake_tokens(PROMPT_IDS, MAX_TOKENS)
                num_before = len(resumed.resume_token_ids)
                assert 3 <= num_before < MAX_TOKENS and list(resumed.resume_token_ids) == expected[:num_before]
                assert list(resumed.prompt_token_ids) == PROMPT_IDS, "the output is not sent as prompt text"
                assert resumed.prefill_kv_address is None and resumed.sampling_params.prompt_logprobs is None
                choices = [c for event in events for c in event.get("choices", [])]
                assert [t for c in choices for t in c["token_ids"]] == expected, "none lost, none repeated"
                assert choices[-1]["finish_reason"] == "length"
                assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
                assert events[-1]["usage"]["prompt_tokens"] == len(PROMPT_IDS)
                assert gateway.metrics.registry.get_sample_value("pdserve_router_migrations_total",
                                                                 {"outcome": "resumed"}) == 1
            finally:
                for engine in engines:
                    engine.close()
    asyncio.run(scenario())
