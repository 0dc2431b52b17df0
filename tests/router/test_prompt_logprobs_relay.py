"""Prompt logprobs through the router in this process, over real ZeroMQ, against scripted engines
(tests/router/fake_engine.py): the link hands PromptLogprobs to the request, the choice gathers them before its
first token from whichever engine prefilled, a missing set is the engine's fault (502), a retry after a failed
prefill still has them, and n samples ask the engines once."""

from __future__ import annotations

import asyncio
import json

from pdserve.control.messages import GenerateRequest, PrefillRequest
from tests.router.conftest import assert_openai_error, router_app
from tests.router.fake_engine import fake_prompt_logprob, fake_tokens
from tests.router.test_engines_and_failures import PROMPT_IDS, completion, serving_engines


def run(model_dir: str, tokenization, engines: list[dict], check) -> None:
    """await check(client, engines) against a router in this process and the fake engines `engines` describe."""
    async def scenario():
        async with router_app(model_dir, tokenization) as (gateway, client):
            async with serving_engines(gateway, *engines) as started:
                await check(client, started)
    asyncio.run(scenario())


def expected_prompt_logprobs(num: int) -> list:
    """vLLM's prompt_logprobs of PROMPT_IDS as the fake engine computes them."""
    return [None] + [{str(token_id + c): {"logprob": fake_prompt_logprob(p, c + 1), "rank": c + 1,
                                          "decoded_token": None} for c in range(max(num, 1))}
                     for p, token_id in enumerate(PROMPT_IDS[1:], start=1)]


def assert_prompt_logprobs(field, num: int, tokenization) -> None:
    for got, want in zip(field, expected_prompt_logprobs(num), strict=True):
        if want is None:
            assert got is None
            continue
        assert list(got) == list(want), got
        for key, value in want.items():
            assert got[key] == {**value, "decoded_token": tokenization.token_text(int(key))}


def request_params(engine) -> list:
    return [m.sampling_params for m in engine.received if isinstance(m, (GenerateRequest, PrefillRequest))]


def test_echo_with_logprobs_from_a_local_prefill(tiny_model, tokenization):
    async def check(client, engines):
        response = await client.post("/v1/completions", json=completion(max_tokens=3, echo=True, logprobs=1))
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        generated = fake_tokens(PROMPT_IDS, 3)
        assert choice["text"] == tokenization.decode(PROMPT_IDS) + tokenization.decode(generated)
        logprobs = choice["logprobs"]
        # the fake engine sends no logprobs of its generated tokens: the prompt's are all there is
        assert logprobs["tokens"] == [tokenization.token_text(t) for t in PROMPT_IDS]
        assert logprobs["token_logprobs"][:5] == [None] + [fake_prompt_logprob(p, 0) for p in range(1, 5)]
        assert logprobs["top_logprobs"][1] == {tokenization.token_text(6): fake_prompt_logprob(1, 0)}
        assert "prompt_logprobs" not in choice
        assert [p.prompt_logprobs for p in request_params(engines[0])] == [1]
    run(tiny_model, tokenization, [{"engine_id": "d0"}], check)


def test_disaggregated_the_prefill_engine_sends_them(tiny_model, tokenization):
    async def check(client, engines):
        prefill, decode = engines
        response = await client.post("/v1/completions", json=completion(max_tokens=4, prompt_logprobs=2))
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert_prompt_logprobs(choice["prompt_logprobs"], 2, tokenization)
        assert choice["logprobs"] is None and choice["text"] == tokenization.decode(fake_tokens(PROMPT_IDS, 4))
        assert [p.prompt_logprobs for p in request_params(prefill)] == [2]
    run(tiny_model, tokenization, [{"role": "prefill", "engine_id": "p0", "first_token": True}, {"engine_id": "d0"}],
        check)


def test_a_decode_token_ahead_of_the_prefill_engines_set_waits_for_it(tiny_model, tokenization):
    """The prefill engine sends its set before the KV the decode engine's first token needs, but on another
    socket: the decode engine's token may reach the router first, and the choice then waits for the set."""
    async def check(client, engines):
        prefill, decode = engines
        response = await client.post("/v1/completions", json=completion(max_tokens=4, prompt_logprobs=1,
                                                                          return_token_ids=True))
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert_prompt_logprobs(choice["prompt_logprobs"], 1, tokenization)
        assert choice["token_ids"] == fake_tokens(PROMPT_IDS, 4), "the decode engine's tokens, none lost or doubled"
        prefill.send_prompt_logprobs = False
        response = await client.post("/v1/completions", json=completion(max_tokens=4, prompt_logprobs=1))
        assert assert_openai_error(response, 502)["code"] == "internal_error", "its first token came without them"
    run(tiny_model, tokenization, [{"role": "prefill", "engine_id": "p0", "first_token": True,
                                    "first_token_delay_s": 0.2}, {"engine_id": "d0", "token_delay_s": 0.01}], check)


def test_a_first_token_without_the_prompt_logprobs_is_the_engines_fault(tiny_model, tokenization):
    async def check(client, engines):
        response = await client.post("/v1/completions", json=completion(echo=True, logprobs=0))
        error = assert_openai_error(response, 502, type_="server_error")
        assert error["code"] == "internal_error" and "before the prompt logprobs" in error["message"]
        fine = await client.post("/v1/completions", json=completion(logprobs=0))
        assert fine.status_code == 200, "a request that did not ask is served"
    run(tiny_model, tokenization, [{"engine_id": "d0", "send_prompt_logprobs": False}], check)


def test_a_retry_after_a_failed_prefill_gathers_them_again(tiny_model, tokenization):
    async def check(client, engines):
        prefill, decode = engines
        response = await client.post("/v1/completions", json=completion(prompt_logprobs=1))
        assert response.status_code == 200, response.text
        assert_prompt_logprobs(response.json()["choices"][0]["prompt_logprobs"], 1, tokenization)
        first, retry = decode.generate_requests()
        assert retry.prefill_kv_address is None, "the retry prefilled on the decode engine, which sent them"
    run(tiny_model, tokenization, [{"role": "prefill", "engine_id": "p0", "fail_prefill": True}, {"engine_id": "d0"}],
        check)


def test_n_samples_ask_once_and_all_report_them(tiny_model, tokenization):
    async def check(client, engines):
        response = await client.post("/v1/completions", json=completion(max_tokens=2, n=3, prompt_logprobs=1,
                                                                          echo=True, logprobs=0))
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == 3
        for choice in choices:
            assert_prompt_logprobs(choice["prompt_logprobs"], 1, tokenization)
            assert choice["logprobs"]["token_logprobs"][:5] == choices[0]["logprobs"]["token_logprobs"][:5]
        assert sorted(p.prompt_logprobs is None for p in request_params(engines[0])) == [False, True, True]
    run(tiny_model, tokenization, [{"engine_id": "d0"}], check)


def test_echo_without_generation_and_the_stream_rules(tiny_model, tokenization):
    async def check(client, engines):
        body = (await client.post("/v1/completions", json=completion(max_tokens=0, echo=True, logprobs=1))).json()
        choice = body["choices"][0]
        assert choice["text"] == tokenization.decode(PROMPT_IDS) and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(PROMPT_IDS)
        assert body["usage"]["completion_tokens"] == 0
        assert [p.max_tokens for p in request_params(engines[0])] == [1]

        streamed = await client.post("/v1/completions", json=completion(max_tokens=3, echo=True, logprobs=1,
                                                                          stream=True))
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        first = events[0]["choices"][0]
        assert first["text"].startswith(tokenization.decode(PROMPT_IDS))
        assert first["logprobs"]["tokens"][:5] == [tokenization.token_text(t) for t in PROMPT_IDS]
        assert all(len(e["choices"][0]["logprobs"]["tokens"]) <= 1 for e in events[1:]), "the prompt's only once"
        assert "".join(e["choices"][0]["text"] for e in events) == \
            tokenization.decode(PROMPT_IDS) + tokenization.decode(fake_tokens(PROMPT_IDS, 3))

        for path, extra in (("/v1/completions", completion()),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            refused = await client.post(path, json={**extra, "stream": True, "prompt_logprobs": 1})
            assert assert_openai_error(refused, 400)["param"] == "prompt_logprobs"
        one = await client.post("/v1/completions", json=completion(max_tokens=2, prompt=[5], prompt_logprobs=1))
        assert one.json()["choices"][0]["prompt_logprobs"] == [None], "a one-token prompt: nothing to send"
    run(tiny_model, tokenization, [{"engine_id": "d0"}], check)
