"""The router's memory through a burst of prompts too big for the model (issue 49 item 5): each is refused
from its length, never tokenized (a 3.9 MiB prompt took hundreds of MB to encode), /health stays fast,
and the heap is trimmed once the burst is over."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.router.conftest import assert_openai_error, health_latencies, wait_until
from tests.router.test_router_limits import router_serving

BIG = "the router memory prompt 数据 " * ((39 << 20) // 10 // 32)  # 3.9 MiB of UTF-8


def bodies() -> list[tuple[str, dict]]:
    return [("/v1/completions", {"prompt": BIG, "max_tokens": 2}),
            ("/v1/completions", {"prompt": ["hi", BIG], "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 2})]


@pytest.mark.hostile
def test_prompts_too_long_for_the_context_are_refused_untokenized_and_the_heap_is_trimmed(tiny_model, tokenization):
    """32 concurrent 3.9 MiB prompts took the router from 343 MiB to 2.4 GB, and 1.9 GB a minute later."""
    encoded = []
    tokenizer = tokenization.tokenizer
    original_encode = tokenizer.encode
    tokenizer.encode = lambda text, *args, **kwargs: encoded.append(len(text)) or original_encode(text, *args, **kwargs)

    async def scenario():
        async with router_serving(tiny_model, tokenization, body_budget_wait_s=30) as (gateway, client):
            payloads = [(path, json.dumps(body, ensure_ascii=False).encode()) for path, body in bodies()] * 3
            burst = asyncio.ensure_future(asyncio.gather(*(client.post(
                path, content=body, headers={"content-type": "application/json"}) for path, body in payloads)))
            latencies = await health_latencies(client, burst)
            for (path, _), answer in zip(payloads, await burst):
                error = assert_openai_error(answer, 400)
                assert "context length is 512 tokens" in error["message"], error
                assert error["param"] == ("messages" if "chat" in path else "prompt"), error
            assert encoded == []  # not one of them reached the tokenizer (not even the batch's "hi")
            assert max(latencies, default=0) <= 1.0, latencies
            budget = client._transport.app.state.body_budget
            await wait_until(lambda: budget.num_trims >= 1, what="the heap trimmed after the burst")
            assert budget.used == 0
            fits = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert fits.status_code == 200, fits.text
            assert encoded == [2]
    try:
        asyncio.run(scenario())
    finally:
        del tokenizer.encode  # the instance attribute: back to the method
