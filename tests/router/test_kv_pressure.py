"""1P1D with a decode engine whose KV pool holds one request at a time (an outside probe: 8 prompts of 700-1100
tokens on `--num-kv-blocks 160` took 238 s, most of them computed twice).

The prefill engine computes prompts faster than the decode engine can take them, so computed prompts wait
for their KVWant longer than --kv-want-timeout. The decode engine has each request queued and says so
(KVHold), so the prefill engine keeps the KV until it is asked for: every prompt moves once, none is
recomputed, nothing leaks. A request with max_tokens=1 goes to the prefill engine alone and moves no KV.

Real engine processes and the router's app in this process, over real sockets."""

from __future__ import annotations

import asyncio

import httpx

from pdserve import LLM, SamplingParams
from pdserve.local_cluster import EngineProcess
from tests.decode.test_disaggregated import start_together, stop_together
from tests.router.conftest import router_server, wait_until

ARGS = ("--dtype", "float32", "--block-size", "4", "--max-num-batched-tokens", "64")
PROMPT_LEN, MAX_TOKENS, NUM_PROMPTS = 48, 40, 4
DECODE_BLOCKS = (PROMPT_LEN + MAX_TOKENS) // 4 + 1  # one request at a time: a second prompt does not fit beside it
PREFILL_BLOCKS = 2 * PROMPT_LEN // 4 + 2  # two computed prompts held, then the third waits for blocks
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(PROMPT_LEN)] for i in range(NUM_PROMPTS)]


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


async def _all_blocks_free(gateway) -> bool:
    await gateway.registry.refresh_stats()
    engines = gateway.registry.engines("prefill") + gateway.registry.engines("decode")
    return all(engine.stats.kv_blocks_used == 0 for engine in engines)


def _run(tiny_model, tokenization, tmp_path, bodies: list[dict], want_timeout: str = "0.1"):
    async def scenario():
        async with router_server(tiny_model, tokenization) as (gateway, url):
            registration = ("--router-address", gateway.registry.registration_address)
            prefill, decode = start_together(
                lambda: EngineProcess("prefill", tiny_model, *ARGS, "--num-kv-blocks", str(PREFILL_BLOCKS),
                                      "--kv-want-timeout", want_timeout, *registration, log_dir=tmp_path),
                lambda: EngineProcess("decode", tiny_model, *ARGS, "--num-kv-blocks", str(DECODE_BLOCKS),
                                      *registration, log_dir=tmp_path))
            try:
                await wait_until(lambda: gateway.registry.engines("prefill") and gateway.registry.engines("decode"),
                                 what="both engines in routing")
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))
                for _ in range(100):  # the acks and frees of the last transfers
                    if await _all_blocks_free(gateway):
                        break
                    await asyncio.sleep(0.05)
                stats = {role: gateway.registry.engines(role)[0].stats for role in ("prefill", "decode")}
                return [answer.json() for answer in answers], stats, decode.log_path.read_text()
            finally:
                stop_together(decode, prefill)

    return asyncio.run(scenario())


def _expected(tiny_model, max_tokens: int) -> list[list[int]]:
    offline = LLM(tiny_model, dtype="float32", block_size=4, num_kv_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in offline.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def test_prompts_the_decode_engine_cannot_take_yet_are_kept_and_moved_once(tiny_model, tokenization, tmp_path):
    answers, stats, decode_log = _run(tiny_model, tokenization, tmp_path,
                                      [_body(prompt, MAX_TOKENS) for prompt in PROMPTS])
    assert [answer["choices"][0]["token_ids"] for answer in answers] == _expected(tiny_model, MAX_TOKENS)
    decode, prefill = stats["decode"], stats["prefill"]
    assert "remote prefill" not in decode_log, "no transfer failed, so no prompt was computed twice"
    assert decode.num_kv_transfers == NUM_PROMPTS and decode.num_kv_transfers_failed == 0
    assert prefill.num_kv_transfers == NUM_PROMPTS and prefill.kv_bytes_sent == decode.kv_bytes_received
    assert prefill.num_kv_transfers_failed == 0, "no held prompt timed out"
    assert decode.kv_blocks_used == 0 and prefill.kv_blocks_used == 0, "no block leaked"


def test_a_request_that_ends_at_its_first_token_moves_no_kv(tiny_model, tokenization, tmp_path):
    """lm-eval's loglikelihood shape (max_tokens=1, also echo without generation): the prefill engine's
    token is the answer; the decode engine never sees the request, and no KV moves."""
    bodies = [_body(prompt, 1) for prompt in PROMPTS]
    bodies.append({**_body(PROMPTS[0], 0), "echo": True, "logprobs": 1})
    answers, stats, _ = _run(tiny_model, tokenization, tmp_path, bodies)
    assert [answer["choices"][0]["token_ids"] for answer in answers[:-1]] == _expected(tiny_model, 1)
    echoed = answers[-1]["choices"][0]
    assert echoed["finish_reason"] == "length" and len(echoed["logprobs"]["tokens"]) == PROMPT_LEN
    decode, prefill = stats["decode"], stats["prefill"]
    assert prefill.kv_bytes_sent == 0 and decode.kv_bytes_received == 0 and decode.num_kv_transfers == 0
    assert decode.num_waiting == decode.num_running == 0 and decode.prefix_cache_queries == 0, "D never had them"
    assert prefill.kv_blocks_used == 0, "freed at once: nobody will ask for them"


def test_a_decode_engine_that_dies_with_requests_queued_does_not_leave_their_kv_held(tiny_model, tokenization,
                                                                                       tmp_path):
    """The prefill engine keeps a prompt that a decode engine has queued (KVHold) for --kv-hold-timeout
    (600 s). If that engine dies, the router, which has stopped listening to the prefill engine after its
    first token, aborts the request there too: the blocks go within the heartbeat timeout. The streams wait for
    another decode engine up to the migration timeout (there is none): 0.5 s, not the default 15 s, ends them."""
    prompt_len, max_tokens = 256, 240  # a second prompt never fits beside the first: ~1 s of decoding each
    prompts = [[(11 * i + j) % 200 + 3 for j in range(prompt_len)] for i in range(3)]

    async def scenario():
        async with router_server(tiny_model, tokenization, max_retries=0, migration_timeout_s=0.5) as (gateway, url):
            registration = ("--router-address", gateway.registry.registration_address)
            prefill, decode = start_together(
                lambda: EngineProcess("prefill", tiny_model, *ARGS, "--num-kv-blocks", str(2 * prompt_len // 4 + 2),
                                      "--kv-want-timeout", "0.1", *registration, log_dir=tmp_path),
                lambda: EngineProcess("decode", tiny_model, *ARGS, "--num-kv-blocks",
                                      str((prompt_len + max_tokens) // 4 + 1), *registration, log_dir=tmp_path))
            try:
                await wait_until(lambda: gateway.registry.engines("prefill") and gateway.registry.engines("decode"),
                                 what="both engines in routing")
                p_link, d_link = gateway.registry.engines("prefill")[0], gateway.registry.engines("decode")[0]

                async def held_for_a_busy_decode_engine() -> bool:
                    await gateway.registry.refresh_stats()
                    p, d = p_link.stats, d_link.stats
                    return (d.num_running == 1 and d.num_waiting >= 1 and p.kv_blocks_used > 0
                            and p.num_waiting == p.num_running == 0)  # P's blocks: computed prompts, held

                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    requests = [asyncio.create_task(client.post("/v1/completions", json=_body(p, max_tokens)))
                                for p in prompts]
                    await wait_until_async(held_for_a_busy_decode_engine, "prompts held for a busy decode engine")
                    await asyncio.sleep(0.2)  # past --kv-want-timeout: only the hold keeps them
                    await gateway.registry.refresh_stats()
                    assert p_link.stats.kv_blocks_used > 0
                    decode.kill()
                    answers = await asyncio.gather(*requests)
                await wait_until_async(lambda: _blocks_free(gateway, p_link), "the held prompts freed", 10.0)
                return [answer.status_code for answer in answers]
            finally:
                stop_together(decode, prefill)

    statuses = asyncio.run(scenario())
    assert statuses[0] == 200 or statuses[0] >= 500, statuses
    assert all(status >= 500 for status in statuses[1:]), statuses


async def _blocks_free(gateway, link) -> bool:
    await gateway.registry.refresh_stats()
    return link.stats.kv_blocks_used == 0


async def wait_until_async(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.025)
