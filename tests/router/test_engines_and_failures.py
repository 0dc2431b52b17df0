"""The router app in this process over real ZeroMQ, against scripted engines (tests/router/fake_engine.py):
registration, heartbeats, static engines, retries, stop strings, 429/503/400 — the paths a real
model cannot be made to walk on cue."""

from __future__ import annotations

import asyncio
import contextlib
import json

from pdserve.control.messages import GenerateRequest
from tests.router.conftest import assert_openai_error, router_app, wait_until
from tests.router.fake_engine import FakeEngine, fake_tokens

PROMPT_IDS = [5, 6, 7, 8, 9]


def run(coro):
    return asyncio.run(coro)


def completion(max_tokens: int = 6, **extra) -> dict:
    return {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "temperature": 0, **extra}


async def _engines(gateway, *specs) -> list[FakeEngine]:
    engines = [FakeEngine(router_address=gateway.registry.registration_address, **spec) for spec in specs]
    await wait_until(lambda: all(any(link.up and link.control_address == e.control_address
                                     for link in gateway.registry.links.values()) for e in engines),
                     what="engines in routing")
    return engines


def _close(engines) -> None:
    for engine in engines:
        engine.close()


@contextlib.asynccontextmanager
async def serving_engines(gateway, *specs):
    """Fake engines (FakeEngine keyword arguments, one dict each) in routing for the block, closed after it."""
    engines = await _engines(gateway, *specs)
    try:
        yield engines
    finally:
        _close(engines)


def test_no_engine_is_503_and_health_says_so(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            response = await client.post("/v1/completions", json=completion())
            assert "decode engine" in assert_openai_error(response, 503, type_="server_error")["message"]
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["engines"] == {"prefill": 0, "decode": 0}
    run(scenario())


def test_registered_engine_serves_completions(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0"}):
                body = (await client.post("/v1/completions", json=completion(return_token_ids=True))).json()
                expected = fake_tokens(PROMPT_IDS, 6)
                choice = body["choices"][0]
                assert choice["token_ids"] == expected and choice["prompt_token_ids"] == PROMPT_IDS
                assert choice["text"] == tokenization.decode(expected)
                assert choice["finish_reason"] == "length"
                assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                                         "prompt_tokens_details": {"cached_tokens": 0}}
                health = (await client.get("/health")).json()
                assert health == {"status": "ok", "engines": {"prefill": 0, "decode": 1}}
    run(scenario())


def test_engine_that_misses_heartbeats_leaves_and_its_request_is_retried(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            stuck, = await _engines(gateway, {"engine_id": "stuck", "token_delay_s": 60})
            request = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await wait_until(lambda: stuck.generate_requests(), what="request on the first engine")
            healthy, = await _engines(gateway, {"engine_id": "healthy"})
            stuck.beating.clear()
            stuck.answering.clear()  # hung: no heartbeats, no tokens
            try:
                response = await asyncio.wait_for(request, 10)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["finish_reason"] == "length"
                assert len(healthy.generate_requests()) == 1, "the retry went to the engine that is alive"
                assert [link.engine_id for link in gateway.registry.engines("decode")] == ["healthy"]
            finally:
                _close([stuck, healthy])
    run(scenario())


def test_engine_lost_mid_stream_ends_the_stream_with_an_error(tiny_model, tokenization):
    """No other decode engine, and the lost one stays silent: the migration gives up after its bound."""
    async def scenario():
        async with router_app(tiny_model, tokenization, migration_timeout_s=0.5) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0", "token_delay_s": 0.05}) as (engine,):

                async def go_silent():
                    await wait_until(lambda: any(a.sent >= 2 for a in engine.active.values()), what="tokens streamed")
                    engine.beating.clear()
                    engine.answering.clear()
                silencer = asyncio.create_task(go_silent())
                response = await client.post("/v1/completions", json=completion(max_tokens=200, stream=True))
                await silencer
                events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
                assert error["code"] == "engine_failed" and "cannot be retried" in error["message"]
                assert "no decode engine took it over" in error["message"] and "--migration-timeout" in error["message"]
                assert gateway.metrics.registry.get_sample_value("pdserve_router_migrations_total", {"outcome": "failed"}) == 1
                assert any(json.loads(e).get("choices") for e in events[:-2]), "tokens streamed before the loss"
    run(scenario())


def test_stop_string_aborts_the_decode_engine(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0"}) as (engine,):
                tokens = fake_tokens(PROMPT_IDS, 40)
                texts = [tokenization.decode(tokens[:i]) for i in range(len(tokens) + 1)]
                cut = next(i for i in range(3, 40) if len(texts[i]) > len(texts[i - 1]) and texts[i][-1].strip())
                stop = texts[cut][-1]
                expected = texts[cut][:texts[cut].index(stop)]
                body = (await client.post("/v1/completions", json=completion(max_tokens=40, stop=[stop]))).json()
                choice = body["choices"][0]
                assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
                assert choice["text"] == expected
                assert body["usage"]["completion_tokens"] < 40
                await wait_until(lambda: engine.aborted, what="Abort at the engine")
                assert engine.aborted[0] == engine.generate_requests()[0].request_id
    run(scenario())


def test_a_request_that_fails_after_the_engine_has_it_is_aborted_there(tiny_model, tokenization, monkeypatch):
    """The router sends a request to the engines before it builds its response; a failure in between
    (here the response formatter, made to raise) must abort the request on the engine and release it."""
    from pdserve.router import responses

    def broken(self, *args, **kwargs):
        raise RuntimeError("formatter broken on purpose")

    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0", "token_delay_s": 0.5}) as (engine,):
                monkeypatch.setattr(responses.Formatter, "__init__", broken)
                for stream in (False, True):
                    response = await client.post("/v1/completions", json=completion(stream=stream))
                    assert "formatter broken on purpose" in assert_openai_error(response, 500)["message"]
                # the engine's thread takes its messages on its own clock: wait for both requests, then both aborts
                await wait_until(lambda: len(engine.generate_requests()) == 2, what="both requests at the engine")
                sent = [request.request_id for request in engine.generate_requests()]
                await wait_until(lambda: sorted(engine.aborted) == sorted(sent), what="both aborted at the engine")
                assert not engine.active and gateway.num_in_flight == 0
                link, = gateway.registry.links.values()
                assert not link.streams, "no delta queue left open in the router"
    run(scenario())


def test_over_the_concurrency_limit_is_429(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, max_concurrent_requests=1) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0", "token_delay_s": 0.05}) as (engine,):
                first = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=10)))
                await wait_until(lambda: engine.generate_requests(), what="first request admitted")
                second = await client.post("/v1/completions", json=completion())
                assert_openai_error(second, 429)
                assert (await first).status_code == 200
                assert (await client.post("/v1/completions", json=completion())).status_code == 200
    run(scenario())


def test_failed_prefill_falls_back_to_prefill_on_the_decode_engine(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"role": "prefill", "engine_id": "p0", "fail_prefill": True},
                                       {"engine_id": "d0", "token_delay_s": 0.02}) as (prefill, decode):
                response = await client.post("/v1/completions", json=completion())
                assert response.status_code == 200, response.text
                first, retry = decode.generate_requests()
                assert first.prefill_kv_address == prefill.kv_address, "the first attempt was disaggregated"
                assert retry.prefill_kv_address is None, "the retry prefills on the decode engine"
                await wait_until(lambda: first.request_id in decode.aborted, what="first attempt aborted")
    run(scenario())


def test_static_engines_are_described_polled_and_disaggregated(tiny_model, tokenization):
    async def scenario():
        prefill, decode = FakeEngine(role="prefill", engine_id="p0"), FakeEngine(engine_id="d0")
        try:
            async with router_app(tiny_model, tokenization, registration_address=None,
                                  prefill_addresses=(prefill.control_address,),
                                  decode_addresses=(decode.control_address,)) as (gateway, client):
                await wait_until(lambda: len(gateway.registry.engines("prefill")) == 1
                                 and len(gateway.registry.engines("decode")) == 1, what="static engines up")
                assert (await client.post("/v1/completions", json=completion())).status_code == 200
                generate, = decode.generate_requests()
                assert generate.prefill_kv_address == prefill.kv_address, "the KV address was discovered"
                assert prefill.received[0].request_id == generate.request_id
                decode.answering.clear()  # a static engine that stops answering leaves routing ...
                await wait_until(lambda: not gateway.registry.engines("decode"), what="silent engine out")
                decode.answering.set()  # ... and comes back when it answers again
                await wait_until(lambda: gateway.registry.engines("decode"), what="engine back")
        finally:
            _close([prefill, decode])
    run(scenario())


def test_engine_rejection_before_any_token_is_400(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0",
                                                 "reject_with": "temperature is wrong: fix it"}) as (engine,):
                response = await client.post("/v1/completions", json=completion())
                assert assert_openai_error(response, 400)["message"] == "temperature is wrong: fix it"
                streamed = await client.post("/v1/completions", json=completion(stream=True))
                assert_openai_error(streamed, 400)
    run(scenario())


def test_engine_failure_before_any_token_is_502_not_400(tiny_model, tokenization):
    """A request the engine failed on its side (e.g. its KV never came, --kv-failure fail) is not the
    client's fault: 502 engine_failed, not 400."""
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0", "reject_with": "remote prefill failed: timeout",
                                                 "reject_code": "kv_transfer_failed"}) as (engine,):
                response = await client.post("/v1/completions", json=completion())
                error = assert_openai_error(response, 502)
                assert error["code"] == "engine_failed" and "remote prefill failed: timeout" in error["message"]
    run(scenario())


def test_a_request_that_failed_an_engine_step_is_502_and_not_retried(tiny_model, tokenization):
    """error_code engine_step_failed: the request made an engine's step raise, so it goes to no other
    engine (it could fail that one too); the client gets 502 with the engine's words."""
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, *({"engine_id": f"d{i}", "reject_with": "the engine failed: boom",
                                                   "reject_code": "engine_step_failed"} for i in range(2))) as engines:
                response = await client.post("/v1/completions", json=completion())
                error = assert_openai_error(response, 502)
                assert error["code"] == "engine_failed" and "the engine failed: boom" in error["message"]
                assert sum(len(engine.generate_requests()) for engine in engines) == 1, "no retry"
    run(scenario())


def test_a_prefill_step_failure_is_not_retried_on_the_decode_engine(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"role": "prefill", "engine_id": "p0", "fail_prefill": True,
                                                 "prefill_error_code": "engine_step_failed"},
                                       {"engine_id": "d0", "token_delay_s": 0.5}) as (prefill, decode):
                response = await client.post("/v1/completions", json=completion())
                assert "fake prefill failure" in assert_openai_error(response, 502)["message"]
                # the GenerateRequest went out with the PrefillRequest; the fake decode engine's thread may
                # record it a moment after the 502 came back
                await wait_until(lambda: decode.generate_requests(), what="the decode engine to get the request")
                first, = decode.generate_requests()
                await wait_until(lambda: first.request_id in decode.aborted, what="the request aborted on decode")
    run(scenario())


def test_sampling_values_float32_cannot_carry_are_400_at_the_edge(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0"}) as (engine,):
                for field, value in [("temperature", 1e39), ("repetition_penalty", 1e-300),
                                     ("repetition_penalty", 1e39)]:
                    response = await client.post("/v1/completions", json=completion(**{field: value}))
                    assert f"{field}={value}" in assert_openai_error(response, 400)["message"]
                assert engine.generate_requests() == [], "refused before any engine saw it"
    run(scenario())


def test_api_key_is_enforced_on_all_but_health(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, api_key="sesame") as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0"}) as (engine,):
                missing = await client.post("/v1/completions", json=completion())
                assert assert_openai_error(missing, 401)["code"] == "invalid_api_key"
                wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
                assert_openai_error(wrong, 401)
                right = await client.post("/v1/completions", json=completion(),
                                          headers={"Authorization": "Bearer sesame"})
                assert right.status_code == 200
                assert (await client.get("/health")).status_code == 200
                assert_openai_error(await client.get("/metrics"), 401)
    run(scenario())


def test_n_choices_are_fanned_out_with_distinct_seeds(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0"}) as (engine,):
                body = (await client.post("/v1/completions", json=completion(n=3, seed=11, temperature=0.8))).json()
                assert [c["index"] for c in body["choices"]] == [0, 1, 2]
                assert body["usage"]["completion_tokens"] == 18 and body["usage"]["prompt_tokens"] == 5
                seeds = sorted(msg.sampling_params.seed for msg in engine.generate_requests())
                assert seeds == [11, 12, 13]
                assert all(isinstance(msg, GenerateRequest) for msg in engine.received)
    run(scenario())


def test_streamed_text_is_whole_characters_across_token_boundaries(tiny_model, tokenization):
    text = "naïve café — 你好, wörld ✓"
    script = tokenization.tokenizer.encode(text)
    assert len(script) > len(text.split()), "multi-byte characters span several byte-level tokens"
    script.append(tokenization.tokenizer.eos_token_id)  # the stop token that ends it: no text of its own

    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0", "script": script,
                                                 "token_delay_s": 0.002}) as (engine,):
                response = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100})
                chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
                assert "".join(pieces) == text
                assert not any("\ufffd" in piece for piece in pieces)
                assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    run(scenario())


def test_every_sampling_parameter_reaches_the_engine_as_sent(tiny_model, tokenization):
    """Each OpenAI knob, set away from its default, arrives in the engine's SamplingParams unchanged:
    dropping any one of them in the router fails this test (an output comparison could not tell)."""
    sent = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "seed": 3, "repetition_penalty": 1.1,
            "presence_penalty": 0.2, "frequency_penalty": 0.1, "max_tokens": 6, "min_tokens": 4,
            "stop_token_ids": [7], "ignore_eos": True, "logprobs": 2, "include_stop_str_in_output": True,
            "logit_bias": {"7": 5.0, "9": -100}}

    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving_engines(gateway, {"engine_id": "d0"}) as (engine,):
                response = await client.post("/v1/completions", json={"prompt": PROMPT_IDS, **sent})
                assert response.status_code == 200, response.text
                params = engine.generate_requests()[0].sampling_params
                received = {name: getattr(params, name) for name in sent}
                assert received == {**sent, "stop_token_ids": (7,), "logit_bias": ((7, 5.0), (9, -100.0))}
    run(scenario())
