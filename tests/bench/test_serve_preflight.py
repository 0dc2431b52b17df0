"""`pdserve bench`'s look at the server before any load: a /v1/models answer with odd cards (an id that is
no string, a root that is no path) is read without an exception."""

from __future__ import annotations

import asyncio

from aiohttp import web

from pdserve.bench.serve_load import open_session
from pdserve.bench.serve_preflight import ServedModel, served_models
from tests.bench.loopback_app import loopback_app


async def models_of(cards: list) -> list[ServedModel]:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": cards})

    async with loopback_app("GET", "/v1/models", models) as url, \
            open_session(None, stall_timeout_s=10, max_concurrency=1) as session:
        return await served_models(session, url)


def test_cards_without_a_string_id_are_skipped_and_a_root_that_is_no_string_is_no_root():
    cards = [{"id": None}, {"id": 7}, {"id": ""}, "fake", {"id": "m", "root": 5}, {"id": "n", "root": "/models/n"}]
    assert asyncio.run(models_of(cards)) == [ServedModel("m", None), ServedModel("n", "/models/n")]
