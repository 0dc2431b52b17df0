"""A prompt's time in the prefill engine's queue does not count against the decode engine's --kv-timeout:
that runs from the prompt being computed (the router relays the prefill engine's first token to the decode
engine), and --kv-queue-timeout bounds the wait before it.

Real engine processes and the router's app in this process. The prefill engine delays its first KV
message by 4 s (tests/decode/faulty_prefill.py), inside its loop: prompt A's KV comes 4 s after A was
computed, past --kv-timeout 2 s, so the decode engine recomputes A. Prompt B, sent while the prefill
engine is stuck in A's send, waits ~4 s in its queue before it is computed; its KV then comes at once,
so B's transfer must succeed, though its KVWant is older than 2 s. The margins are 2 s both ways: CI runs
under load saw A's KV accepted with 1 s margins (the first token's relay to D, which starts A's clock,
came late on a starved host)."""

from __future__ import annotations

import asyncio
import time

import httpx

from pdserve import LLM, SamplingParams
from pdserve.local_cluster import EngineProcess
from tests.decode.test_disaggregated import start_together, stop_together
from tests.router.conftest import ENGINE_ARGS, router_server, wait_until

PROMPT_A, PROMPT_B = [5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]
MAX_TOKENS = 4


def _body(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


async def _until_logged(path, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        await asyncio.sleep(0.02)


def test_queue_time_at_the_prefill_engine_does_not_count_against_the_kv_timeout(tiny_model, tokenization, tmp_path):
    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            registration = ("--router-address", gateway.registry.registration_address)
            prefill, decode = start_together(
                lambda: EngineProcess("prefill", tiny_model, *ENGINE_ARGS, *registration, "--fault", "delay:0:4",
                                      log_dir=tmp_path, module="tests.decode.faulty_prefill"),
                lambda: EngineProcess("decode", tiny_model, *ENGINE_ARGS, *registration, "--kv-timeout", "2",
                                      log_dir=tmp_path))
            try:
                await wait_until(lambda: gateway.registry.engines("prefill") and gateway.registry.engines("decode"),
                                 what="both engines in routing")
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    first = asyncio.create_task(client.post("/v1/completions", json=_body(PROMPT_A)))
                    await _until_logged(prefill.log_path, "fault injection: delaying")  # P is stuck in A's send
                    second = await client.post("/v1/completions", json=_body(PROMPT_B))
                    first = await first
                await gateway.registry.refresh_stats()
                stats = gateway.registry.engines("decode")[0].stats
                return first.json(), second.json(), stats
            finally:
                stop_together(decode, prefill)

    answer_a, answer_b, decode_stats = asyncio.run(scenario())
    offline = LLM(tiny_model, dtype="float32", block_size=4, num_kv_blocks=512)
    for answer, prompt in ((answer_a, PROMPT_A), (answer_b, PROMPT_B)):
        expected = offline.generate({"prompt_token_ids": prompt},
                                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
        assert answer["choices"][0]["token_ids"] == expected.outputs[0].token_ids, answer
    assert decode_stats.num_kv_transfers_failed == 1, "A's KV came past --kv-timeout after A was computed"
    assert decode_stats.num_kv_transfers == 1, "B's KV, asked for before B waited in the queue, was used"
