"""What a careless client or an attacker sends the HTTP API: each gets a clear answer early, costs the
server little, and leaves it serving (found by probing a running `pdserve up` from outside)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from pdserve.router import body_route
from tests.router.conftest import assert_openai_error, health_latencies, router_app, router_server, wait_until
from tests.router.test_router_limits import chat, router_serving, serving

BODY = b'{"prompt": "hi", "max_tokens": 2}'


def run(coro) -> None:
    asyncio.run(coro)


def requests_with_status(gateway, status: int) -> float:
    return gateway.metrics.registry.get_sample_value(
        "pdserve_requests_total", {"endpoint": "/v1/completions", "status": str(status)}) or 0.0


async def raw_request(url: str, head: bytes, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + body)
    await writer.drain()
    return reader, writer


def post_head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_that_is_not_json_is_415_naming_the_header(tiny_model, tokenization):
    async def scenario():
        async with router_serving(tiny_model, tokenization) as (gateway, client):
            for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                            {}):
                answer = await client.post("/v1/completions", content=BODY, headers=headers)
                error = assert_openai_error(answer, 415)
                assert "Content-Type: application/json" in error["message"], error
            empty = await client.post("/v1/completions", content=b"")  # no body at all: still the 400 it was
            assert "Field required" in assert_openai_error(empty, 400)["message"]
            sent = await client.post("/v1/completions", content=BODY, headers={"content-type": "application/json"})
            assert sent.status_code == 200, sent.text
    run(scenario())


def test_head_health_answers_like_get(tiny_model, tokenization):
    async def scenario():
        async with router_serving(tiny_model, tokenization) as (gateway, client):
            head = await client.head("/health")
            assert head.status_code == 200 and head.content == b""
    run(scenario())


def test_a_batch_over_the_choice_limit_is_refused_before_it_is_tokenized(tiny_model, tokenization):
    async def scenario():
        async with router_serving(tiny_model, tokenization) as (gateway, client):
            tokenized = []
            original = gateway.tokenization.completion_prompts
            gateway.tokenization.completion_prompts = lambda body, *rest: tokenized.append(body) or original(body, *rest)
            try:
                answer = await client.post("/v1/completions", json={"prompt": ["hi there"] * 100_000})
                error = assert_openai_error(answer, 400)
                assert error["param"] == "n" and "100000 prompt(s)" in error["message"]
                assert tokenized == []
            finally:
                del gateway.tokenization.completion_prompts  # the instance attribute: back to the method
    run(scenario())


def test_a_client_that_leaves_mid_body_is_499_without_a_traceback(tiny_model, tokenization, caplog):
    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            async with serving(gateway, engine_id="d0"):
                for _ in range(3):
                    _, writer = await raw_request(url, post_head(len(BODY)), BODY[:10])
                    writer.close()
                await wait_until(lambda: requests_with_status(gateway, 499) == 3, what="three 499s counted")
                assert requests_with_status(gateway, 500) == 0
    with caplog.at_level(logging.INFO, logger="pdserve"):
        run(scenario())
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


def test_a_body_that_trickles_past_the_limit_is_408(tiny_model, tokenization, monkeypatch):
    monkeypatch.setattr(body_route, "BODY_TIMEOUT_S", 0.5)

    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            async with serving(gateway, engine_id="d0"):
                reader, writer = await raw_request(url, post_head(len(BODY)), BODY[:5])  # the rest never comes
                status_line = await asyncio.wait_for(reader.readline(), timeout=10)
                response = await asyncio.wait_for(reader.read(4096), timeout=10)
                writer.close()
                assert status_line.startswith(b"HTTP/1.1 408"), status_line
                assert b"request_timeout" in response and b"within 0.5s" in response
    run(scenario())


def test_a_flood_of_metrics_scrapes_shares_its_engine_round_trips(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving(gateway, engine_id="d0") as engine:
                before = engine.stats_requests
                answers = await asyncio.gather(*(client.get("/metrics") for _ in range(40)))
                assert all(answer.status_code == 200 for answer in answers)
                assert "pdserve_engine" in answers[-1].text
                asked = engine.stats_requests - before
                assert 1 <= asked < 40 / 4, asked  # scrapes in flight together share one refresh
    run(scenario())


def test_a_connection_whose_headers_do_not_come_is_closed_with_408(tiny_model, tokenization, monkeypatch):
    """Idle sockets and trickled headers used up the router's file descriptors: each now has HEADER_TIMEOUT_S."""
    from pdserve.router import header_deadline

    monkeypatch.setattr(header_deadline, "HEADER_TIMEOUT_S", 0.5)

    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            async with serving(gateway, engine_id="d0"):
                silent_reader, silent = await raw_request(url, b"", b"")  # connects, says nothing
                slow_reader, slow = await raw_request(url, b"GET /health HTTP/1.1\r\nHost: rou", b"")
                for reader in (silent_reader, slow_reader):
                    answer = await asyncio.wait_for(reader.read(), timeout=5)  # b"" unless answered: then EOF
                    assert answer.startswith(b"HTTP/1.1 408"), answer
                for writer in (silent, slow):
                    writer.close()
                # a request whose headers come at once is served, and its kept-alive connection stays usable
                reader, writer = await raw_request(url, b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n", b"")
                assert (await asyncio.wait_for(reader.readline(), timeout=5)).startswith(b"HTTP/1.1 200")
                writer.close()
    run(scenario())


# ---- HTTP limits like a hardened server's (issue #49 item 6) ----

def _send_big_header(url: str, header_bytes: int) -> bytes:
    """Sends a GET /health whose one header holds `header_bytes` bytes (from a thread, blocking) and returns
    what the server answered before it closed the connection."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        answer = b""
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: router\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            for _ in range(header_bytes // len(chunk)):
                sock.sendall(chunk)
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the header was whole: the answer is already waiting
        try:
            while data := sock.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
        return answer


@pytest.mark.hostile
def test_headers_over_the_cap_are_431_and_health_stays_fast(tiny_model, tokenization):
    """A 64 MiB header was read whole and answered 200; eight of them stalled /health for 8.4 s."""
    from pdserve.router.header_deadline import MAX_HEADER_BYTES

    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            async with serving(gateway, engine_id="d0"), httpx.AsyncClient(base_url=url, timeout=10) as client:
                attacks = [asyncio.to_thread(_send_big_header, url, size) for size in [64 << 20] * 4 + [1 << 20]]
                attack = asyncio.ensure_future(asyncio.gather(*attacks))
                latencies = await health_latencies(client, attack, interval=0.01)
                for answer in await attack:
                    head, _, body = answer.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 431"), answer[:200]
                    error = json.loads(body)["error"]
                    assert f"limit of {MAX_HEADER_BYTES} bytes" in error["message"], error
                    assert error["code"] == "request_header_fields_too_large"
                assert max(latencies) <= 1.0, latencies
                # headers under the cap are served as before, on a real socket
                fine = await client.get("/health", headers={"x-fine": "a" * (MAX_HEADER_BYTES // 2)})
                assert fine.status_code == 200, fine.text
    run(scenario())


@pytest.mark.hostile
def test_repeated_wrong_keys_from_one_address_get_429_with_retry_after(tiny_model, tokenization):
    """300 wrong keys at 922/s met only 401s: now an address has a few failures, then waits."""
    from pdserve.router.auth_throttle import BURST

    async def scenario():
        async with router_serving(tiny_model, tokenization, api_key="right") as (gateway, client):
            wrong = {"authorization": "Bearer wrong"}
            answers = [await client.post("/v1/completions", content=BODY, headers=wrong) for _ in range(BURST + 5)]
            assert [a.status_code for a in answers[:BURST]] == [401] * BURST
            slowed = answers[BURST]
            error = assert_openai_error(slowed, 429, type_="rate_limit_error")
            assert "wrong or missing API key" in error["message"], error
            assert int(slowed.headers["retry-after"]) >= 1
            # while it waits, even the right key is not compared (a guess that hits learns nothing)
            right = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                      headers={"authorization": "Bearer right"})
            assert right.status_code == 429
            await asyncio.sleep(1.1)  # one failure's worth refilled
            right = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                      headers={"authorization": "Bearer right"})
            assert right.status_code == 200, right.text
    run(scenario())


def test_the_auth_throttle_refills_and_remembers_a_bounded_number_of_addresses():
    from pdserve.router.auth_throttle import AuthThrottle

    now = [0.0]
    throttle = AuthThrottle(burst=2, refill_per_s=0.5, max_clients=3, clock=lambda: now[0])
    throttle.failed("a")
    assert throttle.wait_s("a") == 0
    throttle.failed("a")
    assert throttle.wait_s("a") == 2  # one token comes back in 1 / 0.5 s
    now[0] = 2.0
    assert throttle.wait_s("a") == 0
    for address in ("b", "c", "d", "e"):
        throttle.failed(address)
    assert len(throttle) == 3 and throttle.wait_s("a") == 0  # "a", the least recently failed, was forgotten


@pytest.mark.hostile
def test_a_trailing_slash_is_404_not_a_redirect_to_the_host_header(tiny_model, tokenization):
    """/v1/completions/ answered, before any key check, a 307 to http://<Host header>/v1/completions."""
    async def scenario():
        for api_key in (None, "right"):
            async with router_server(tiny_model, tokenization, api_key=api_key) as (gateway, url):
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    for method in ("GET", "POST"):
                        for path in ("/v1/completions/", "/v1/chat/completions/", "/health/", "/v1/models/"):
                            answer = await client.request(method, path, headers={"host": "evil.example"},
                                                          content=BODY)
                            assert answer.status_code in (401, 404, 405), (method, path, answer.status_code)
                            assert "location" not in answer.headers
                            assert "evil.example" not in answer.text
    run(scenario())


# ---- router memory bounded (issue 49 item 5) ----

@pytest.mark.hostile
def test_a_batch_of_650000_prompts_is_refused_before_validation_and_health_stays_fast(tiny_model, tokenization):
    """650,000 one-token prompts in 3.9 MiB were validated whole (seconds on the loop) before their 400."""
    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            async with serving(gateway, engine_id="d0"), httpx.AsyncClient(base_url=url, timeout=30) as client:
                for prompt in ([[1]] * 650_000, ["a"] * 650_000):
                    body = json.dumps({"prompt": prompt, "max_tokens": 1, "n": 1}).encode()
                    refused = asyncio.ensure_future(client.post(
                        "/v1/completions", content=body, headers={"content-type": "application/json"}))
                    latencies = []
                    while not refused.done():
                        start = time.monotonic()
                        assert (await client.get("/health")).status_code == 200
                        latencies.append(time.monotonic() - start)
                    error = assert_openai_error(await refused, 400)
                    assert error["param"] == "n" and "650000 prompt(s)" in error["message"], error
                    assert max(latencies, default=0) <= 1.0, latencies
    run(scenario())


def test_the_body_budget_makes_a_request_wait_then_answers_503_with_retry_after(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, max_body_bytes_in_flight=1000,
                              body_budget_wait_s=0.2) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                budget = client._transport.app.state.body_budget
                async with budget.holding(990):  # another request's body, being parsed
                    answer = await client.post("/v1/completions", content=BODY,
                                               headers={"content-type": "application/json"})
                    error = assert_openai_error(answer, 503)
                    assert answer.headers["retry-after"] == "1" and "limit at once is 1000" in error["message"]
                    late = asyncio.ensure_future(client.post("/v1/completions", content=BODY,
                                                             headers={"content-type": "application/json"}))
                    await asyncio.sleep(0.05)  # it waits for room ...
                assert (await late).status_code == 200  # ... and is served once the other body is done
                assert budget.used == 0
    run(scenario())


# ---- /health says when the router cannot serve (issue 49 item 4) ----

@pytest.mark.hostile
def test_health_is_503_while_every_tokenizer_thread_is_held_past_its_limit(tiny_model, tokenization):
    """Runaway template renders took every tokenizer thread and every later request got a 503, while /health said ok."""
    import threading

    from pdserve.router.preprocess import PreprocessTimeout

    async def scenario():
        async with router_app(tiny_model, tokenization, num_preprocess_threads=1,
                              preprocess_timeout_s=0.2) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                release = threading.Event()
                with pytest.raises(PreprocessTimeout):
                    await gateway.preprocessor.run(release.wait, 10)
                stuck = await client.get("/health")
                assert stuck.status_code == 503 and "tokenizer thread" in stuck.json()["status"], stuck.text
                release.set()
                await wait_until(lambda: not gateway.preprocessor.stuck, what="the thread freed")
                assert (await client.get("/health")).status_code == 200
    run(scenario())
