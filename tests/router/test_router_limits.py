"""The router cannot be blocked: body size limit, tokenization and templates off the event loop with a
time limit and a bounded pool, request-supplied templates refused, malformed text, auth on /metrics
and /openapi.json, Retry-After, 499 for every disconnect, logit_bias keys, and a flood of registrations.
The router app runs in this process over real ZeroMQ, against scripted engines (fake_engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import pytest
import zmq

from pdserve.control.messages import Register
from pdserve.control.protocol import encode
from pdserve.router.preprocess import QUEUE_WAIT_FACTOR, PreprocessTimeout
from tests.router.conftest import assert_openai_error, health_latencies, router_app, router_server, wait_until
from tests.router.fake_engine import FakeEngine, fake_tokens

PROMPT_IDS = [5, 6, 7, 8, 9]
# ~50M template loop iterations: a few seconds of CPU, from a request of about a hundred bytes
TEMPLATE_BOMB = ("{% for a in range(50000) %}{% for b in range(1000) %}{% if a == b %}.{% endif %}{% endfor %}"
                 "{% endfor %}")


def run(coro):
    return asyncio.run(coro)


def completion(max_tokens: int = 6, **extra) -> dict:
    return {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "temperature": 0, **extra}


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


async def _engine(gateway, **spec) -> FakeEngine:
    engine = FakeEngine(router_address=gateway.registry.registration_address, **spec)
    await wait_until(lambda: any(link.up and link.control_address == engine.control_address
                                 for link in gateway.registry.links.values()), what="engine in routing")
    return engine


@contextlib.asynccontextmanager
async def serving(gateway, **spec):
    """A fake engine in routing for the block, closed after it."""
    engine = await _engine(gateway, **spec)
    try:
        yield engine
    finally:
        engine.close()


@contextlib.asynccontextmanager
async def router_serving(model_dir: str, tokenization, **overrides):
    """(gateway, httpx client) of a router app (router_app) with one fake decode engine, "d0", in routing."""
    async with router_app(model_dir, tokenization, **overrides) as (gateway, client), serving(gateway, engine_id="d0"):
        yield gateway, client


# ---- request bodies ----

def test_body_over_the_limit_is_413_before_it_is_read(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, max_request_bytes=1000) as (_, client):
            sent = []

            async def body():
                for _ in range(4):
                    sent.append(1)
                    yield b"x" * 500

            declared = await client.post("/v1/completions", content=body(), headers={"Content-Length": "2000"})
            error = assert_openai_error(declared, 413, type_="invalid_request_error")
            assert "1000 bytes" in error["message"] and "--max-request-bytes" in error["message"]
            assert sent == [], "the body was read although its Content-Length is over the limit"
            chunked = await client.post("/v1/completions", content=body())  # no Content-Length
            assert assert_openai_error(chunked, 413)["code"] == "request_too_large"
            assert len(sent) < 8
    run(scenario())


def test_large_prompt_does_not_block_health(tiny_model, tokenization):
    async def scenario():
        async with router_serving(tiny_model, tokenization, preprocess_timeout_s=60) as (gateway, client):
            prompt = "hello world, this is text. " * 110_000  # 3 MB: seconds of tokenizing
            busy = asyncio.create_task(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))
            latencies = await health_latencies(client, busy)
            assert "context length" in assert_openai_error(await busy, 400)["message"]
            assert len(latencies) > 3 and max(latencies) < 1.0, latencies
    bound, tokenization.prompt_bound = tokenization.prompt_bound, None  # tokenized, not refused from its length
    try:
        run(scenario())
    finally:
        tokenization.prompt_bound = bound


def test_template_bomb_times_out_without_blocking_health(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, allow_request_chat_template=True,
                              preprocess_timeout_s=0.5) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                started = time.monotonic()
                busy = asyncio.create_task(client.post("/v1/chat/completions", json=chat(chat_template=TEMPLATE_BOMB)))
                latencies = await health_latencies(client, busy)
                error = assert_openai_error(await busy, 400)
                assert error["code"] == "preprocessing_timeout" and "0.5s" in error["message"]
                assert time.monotonic() - started < 2.0
                assert max(latencies) < 1.0, latencies
    run(scenario())


def test_a_burst_beyond_the_tokenizer_threads_waits_for_them(tiny_model, tokenization):
    """One tokenizer thread, twelve chats at once: each waits its turn, none is refused."""
    async def scenario():
        async with router_serving(tiny_model, tokenization, num_preprocess_threads=1) as (gateway, client):
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat())
                                             for _ in range(12)))
            assert [answer.status_code for answer in answers] == [200] * 12, [a.text for a in answers]
            assert gateway.preprocessor.num_running == 0
    run(scenario())


def test_runaway_renders_on_every_thread_make_waiting_requests_503_not_400(tiny_model, tokenization):
    """A runaway render keeps the one thread after its own 400. A request waiting behind it is not blamed
    for that time (no 400 for a prompt it did not send): it gets a 503 with Retry-After once no thread has
    come free for QUEUE_WAIT_FACTOR time limits."""
    async def scenario():
        async with router_app(tiny_model, tokenization, num_preprocess_threads=1,
                              preprocess_timeout_s=0.2) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                release = threading.Event()  # a job that ignores its time limit (request templates are killed)
                runaway = asyncio.create_task(gateway.preprocessor.run(release.wait, 30))
                await wait_until(lambda: gateway.preprocessor.num_running == 1, what="the runaway on the thread")
                started = time.monotonic()
                waiting = await client.post("/v1/chat/completions", json=chat())
                assert assert_openai_error(waiting, 503)["code"] == "server_busy"
                assert waiting.headers["Retry-After"] == "1"
                assert time.monotonic() - started >= QUEUE_WAIT_FACTOR * 0.2
                with pytest.raises(PreprocessTimeout):
                    await runaway
                release.set()
    run(scenario())


def test_requests_waiting_for_a_tokenizer_thread_are_bounded(tiny_model, tokenization):
    """Waiting requests hold their bodies: no more than --max-concurrent-requests wait; the next gets a 503 at once."""
    async def scenario():
        async with router_app(tiny_model, tokenization, num_preprocess_threads=1,
                              preprocess_timeout_s=0.5, max_concurrent_requests=2) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                release = threading.Event()  # a job that ignores its time limit (request templates are killed)
                runaway = asyncio.create_task(gateway.preprocessor.run(release.wait, 30))
                await wait_until(lambda: gateway.preprocessor.num_running == 1, what="the runaway on the thread")
                waiting = [asyncio.create_task(client.post("/v1/chat/completions", json=chat())) for _ in range(2)]
                await wait_until(lambda: gateway.preprocessor.num_waiting == 2, what="two requests waiting")
                started = time.monotonic()
                refused = await client.post("/v1/chat/completions", json=chat())
                assert time.monotonic() - started < 1.0
                error = assert_openai_error(refused, 503)
                assert error["code"] == "server_busy" and "2 requests are already waiting" in error["message"]
                with pytest.raises(PreprocessTimeout):
                    await runaway
                release.set()
                for task in waiting:
                    await task
    run(scenario())


# ---- what a request may say ----

def test_request_chat_template_is_refused_unless_allowed(tiny_model, tokenization):
    async def scenario():
        async with router_serving(tiny_model, tokenization) as (gateway, client):
            for body in (chat(chat_template="{{ 1 }}"), chat(chat_template_kwargs={"chat_template": "{{ 1 }}"})):
                error = assert_openai_error(await client.post("/v1/chat/completions", json=body), 400)
                assert "--allow-request-chat-template" in error["message"]
            renderer = chat(chat_template_kwargs={"tokenize": True})
            error = assert_openai_error(await client.post("/v1/chat/completions", json=renderer), 400)
            assert "tokenize" in error["message"] and error["param"] == "chat_template_kwargs"
            variables = chat(chat_template_kwargs={"enable_thinking": False})
            assert (await client.post("/v1/chat/completions", json=variables)).status_code == 200
        async with router_serving(tiny_model, tokenization, allow_request_chat_template=True) as (gateway, client):
            body = chat(chat_template="{{ messages[0]['content'] }} there", return_token_ids=True)
            answer = (await client.post("/v1/chat/completions", json=body)).json()
            assert answer["prompt_token_ids"] == tokenization.tokenizer.encode("hi there", add_special_tokens=False)
    run(scenario())


def test_lone_surrogates_are_400_naming_the_field(tiny_model, tokenization):
    async def scenario():
        async with router_serving(tiny_model, tokenization) as (gateway, client):
            headers = {"Content-Type": "application/json"}
            text = await client.post("/v1/completions", headers=headers,
                                     content=b'{"prompt": "abc\\ud800", "max_tokens": 2}')
            error = assert_openai_error(text, 400)
            assert "prompt" in error["message"] and "surrogate" in error["message"]
            message = await client.post("/v1/chat/completions", headers=headers,
                                        content=b'{"messages": [{"role": "user", "content": "\\udc00"}]}')
            assert "messages.0.content" in assert_openai_error(message, 400)["message"]
            pair = await client.post("/v1/completions", headers=headers,
                                     content=b'{"prompt": "a\\ud83d\\ude00", "max_tokens": 2}')
            assert pair.status_code == 200, pair.text
    run(scenario())


def test_a_logit_bias_that_names_no_token_of_the_model_is_refused(tiny_model, tokenization):
    async def scenario():
        async with router_serving(tiny_model, tokenization) as (gateway, client):
            for bias, says in (({"seven": 5}, "is not a token id"), ({"-3": 5}, "is not a token id"),
                               ({"7": 100.5}, "must be in [-100, 100]"),
                               ({str(10**9): 1}, "outside the model's vocabulary")):
                for path, body in (("/v1/completions", completion(logit_bias=bias)),
                                   ("/v1/chat/completions", chat(logit_bias=bias))):
                    error = assert_openai_error(await client.post(path, json=body), 400)
                    assert error["param"] == "logit_bias" and says in error["message"], (bias, error)
    run(scenario())


# ---- the server's own pages, and answers ----

def test_metrics_and_openapi_need_the_api_key(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, api_key="sesame") as (_, client):
            auth = {"Authorization": "Bearer sesame"}
            for path in ("/metrics", "/openapi.json"):
                assert_openai_error(await client.get(path), 401)
                assert (await client.get(path, headers=auth)).status_code == 200
            assert "/v1/completions" in (await client.get("/openapi.json", headers=auth)).json()["paths"]
            for path in ("/docs", "/redoc"):
                assert (await client.get(path)).status_code == 404
            missing = await client.post("/v1/embeddings", json={"input": "hi"})
            assert_openai_error(missing, 404)
            assert missing.json()["error"]["message"] == (
                "POST /v1/embeddings is not an endpoint of this server: it serves POST /v1/completions, POST "
                "/v1/chat/completions, GET /v1/models, GET /health, GET /metrics and GET /version")
            wrong_method = await client.get("/v1/completions", headers=auth)
            assert_openai_error(wrong_method, 405)
            assert wrong_method.json()["error"]["message"] == "/v1/completions takes POST, not GET"
            assert wrong_method.headers["allow"] == "POST"
            assert (await client.get("/health")).status_code == 503  # open, and says no engine yet
    run(scenario())


def test_429_says_when_to_retry(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, max_concurrent_requests=1) as (gateway, client):
            async with serving(gateway, engine_id="d0", token_delay_s=0.05) as engine:
                first = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=10)))
                await wait_until(lambda: engine.generate_requests(), what="first request admitted")
                second = await client.post("/v1/completions", json=completion())
                assert_openai_error(second, 429)
                assert second.headers["Retry-After"] == "1"
                assert (await first).status_code == 200
    run(scenario())


def _requests_counted(gateway, endpoint: str, status: str) -> float:
    return gateway.metrics.registry.get_sample_value("pdserve_requests_total",
                                                     {"endpoint": endpoint, "status": status}) or 0.0


def test_every_client_disconnect_is_counted_as_499(tiny_model, tokenization):
    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            async with serving(gateway, engine_id="d0", token_delay_s=0.2):
                # gone 0.1 s into the wait for its first token (0.2 s away); connecting may take longer on a busy
                # machine, and a connect timeout would leave the router nothing to count
                quick_reader = httpx.Timeout(0.1, connect=10.0, pool=10.0)
                async with httpx.AsyncClient(base_url=url, timeout=quick_reader) as client:
                    for stream in (False, True):
                        with contextlib.suppress(httpx.ReadTimeout):
                            await client.post("/v1/completions", json=completion(max_tokens=50, stream=stream))
                body = completion(max_tokens=50, stream=True)
                async with httpx.AsyncClient(base_url=url, timeout=5) as client, \
                        client.stream("POST", "/v1/completions", json=body) as response:  # gone mid-stream
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            break
                await wait_until(lambda: _requests_counted(gateway, "/v1/completions", "499") == 3,
                                 what="three disconnects counted as 499")
    run(scenario())


# ---- registration ----

def test_a_bad_registration_does_not_stop_registration(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            context = zmq.Context()
            dealer = context.socket(zmq.DEALER)
            dealer.connect(gateway.registry.registration_address)
            bogus = Register(engine_id="bogus", role="decode", control_address="not an address", block_size=4,
                             max_model_len=512, vocab_size=1024)
            dealer.send_multipart(encode(bogus))
            await asyncio.sleep(0.3)
            async with serving(gateway, engine_id="d0"):
                assert (await client.post("/v1/completions", json=completion())).status_code == 200
                dealer.close(linger=0)
                context.term()
    run(scenario())


def test_a_flood_of_registrations_leaves_routing_intact(tiny_model, tokenization):
    """1000 distinct peers register engines that never answer: the real engine keeps serving, and the
    router holds a bounded number of links."""
    async def scenario():
        async with router_app(tiny_model, tokenization, heartbeat_timeout_s=2.0) as (gateway, client):
            engine = await _engine(gateway, engine_id="real")
            context = zmq.Context()
            dealers = []
            try:
                for i in range(1000):
                    dealer = context.socket(zmq.DEALER)
                    dealer.connect(gateway.registry.registration_address)
                    dealer.send_multipart(encode(Register(
                        engine_id=f"flood-{i}", role="decode", control_address=f"tcp://127.0.0.1:{20000 + i}",
                        block_size=4, max_model_len=512, vocab_size=1024)))
                    dealers.append(dealer)
                await asyncio.sleep(1.0)
                for _ in range(3):
                    response = await client.post("/v1/completions", json=completion(return_token_ids=True))
                    assert response.json()["choices"][0]["token_ids"] == fake_tokens(PROMPT_IDS, 6)
                health = (await client.get("/health")).json()
                assert health == {"status": "ok", "engines": {"prefill": 0, "decode": 1}}
                metrics = (await client.get("/metrics")).text
                assert metrics.count("pdserve_engine_up{") <= 65
            finally:
                engine.close()
                for dealer in dealers:
                    dealer.close(linger=0)
                context.term()
    run(scenario())


def test_a_host_that_is_not_this_machines_is_named_not_the_port():
    from pdserve.router.server import bind_http

    with pytest.raises(ValueError, match="give --host an address of this machine"):
        bind_http("999.1.1.1", 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="pick a free --port"):
            bind_http("127.0.0.1", taken.getsockname()[1])
