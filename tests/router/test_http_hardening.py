"""What a careless client or an attacker sends the HTTP API: each gets a clear answer early, costs the
server little, and leaves it serving (found by probing a running `pdserve up` from outside)."""

from __future__ import annotations

import asyncio
import logging

from pdserve.router import lean_routes
from tests.router.conftest import assert_openai_error, router_app, router_server, wait_until
from tests.router.test_router_limits import chat, serving

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
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
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
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                head = await client.head("/health")
                assert head.status_code == 200 and head.content == b""
    run(scenario())


def test_a_batch_over_the_choice_limit_is_refused_before_it_is_tokenized(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                tokenized = []
                original = gateway.tokenization.completion_prompts
                gateway.tokenization.completion_prompts = lambda body: tokenized.append(body) or original(body)
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
    monkeypatch.setattr(lean_routes, "BODY_TIMEOUT_S", 0.5)

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
