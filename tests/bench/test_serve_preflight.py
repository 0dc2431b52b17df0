"""`pdserve bench`'s look at the server before any load: a /v1/models answer with odd cards (an id that is
no string, a root that is no path) is read without an exception."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from pdserve.bench.serve_load import open_session
from pdserve.bench.serve_preflight import ServedModel, served_models


async def models_of(cards: list) -> list[ServedModel]:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": cards})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        async with open_session(None, stall_timeout_s=10, max_concurrency=1) as session:
            return await served_models(session, f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:
        await runner.cleanup()


def test_cards_without_a_string_id_are_skipped_and_a_root_that_is_no_string_is_no_root():
    cards = [{"id": None}, {"id": 7}, {"id": ""}, "fake", {"id": "m", "root": 5}, {"id": "n", "root": "/models/n"}]
    assert asyncio.run(models_of(cards)) == [ServedModel("m", None), ServedModel("n", "/models/n")]
