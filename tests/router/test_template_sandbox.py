"""Request-supplied chat templates render in worker processes killed at the time limit (issue 49 item 4):
a loop bomb's thread kept 96% of a CPU after its 400, and four bombs turned every later request into a 503."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.router.conftest import assert_openai_error, router_app, wait_until
from tests.router.test_router_limits import TEMPLATE_BOMB, chat, serving


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.hostile
def test_template_bombs_are_killed_and_later_requests_are_served(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, allow_request_chat_template=True, num_preprocess_threads=4,
                              preprocess_timeout_s=1.0) as (gateway, client):
            async with serving(gateway, engine_id="d0"):
                sandbox = gateway.template_sandbox
                simple = chat(chat_template="{{ messages[0]['content'] }} there", return_token_ids=True)
                started = time.monotonic()
                await _until_served(client, simple)
                first_pids = set(sandbox.worker_pids())
                bombs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(chat_template=TEMPLATE_BOMB))
                                               for _ in range(4)))
                for answer in bombs:  # killed at its limit, or (two waited for the two workers) answered at it
                    assert assert_openai_error(answer, 400)["code"] == "preprocessing_timeout"
                await wait_until(lambda: sandbox.num_kills == 4, timeout=30, what="every bomb's worker killed")
                assert not first_pids & set(sandbox.worker_pids())  # the bombs' workers are gone
                for pid in first_pids:
                    assert not os.path.exists(f"/proc/{pid}"), pid  # killed and reaped, not burning a CPU
                answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat()) for _ in range(8)))
                assert [answer.status_code for answer in answers] == [200] * 8  # the model's template: no worker
                await _until_served(client, simple)  # the replacements have loaded the tokenizer
                answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=simple) for _ in range(4)))
                for answer in answers:
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["prompt_token_ids"] == tokenization.tokenizer.encode(
                        "hi there", add_special_tokens=False)
                assert (await client.get("/health")).status_code == 200
                await wait_until(lambda: gateway.preprocessor.num_running == 0, timeout=30, what="every thread free")
                pids = sandbox.worker_pids()
                before = [cpu_ticks(pid) for pid in pids]
                await asyncio.sleep(0.5)
                assert [cpu_ticks(pid) for pid in pids] == before  # idle workers: no render left running
                assert time.monotonic() - started < 120
    asyncio.run(scenario())


async def _until_served(client, body, timeout_s: float = 60.0) -> None:
    """The first render waits for a worker to load the tokenizer (seconds on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = await client.post("/v1/chat/completions", json=body)
        if answer.status_code == 200 or time.monotonic() > deadline:
            assert answer.status_code == 200, answer.text
            return
        await asyncio.sleep(0.2)
