"""2P2D caught in a cycle of KV waits that only the prefill engines' deadlock breaker ends
(prefill/transfer_side.py `_release_for_wanted_prompt`). Real engine processes over real sockets.

Each KV pool holds one prompt. The four requests reach the engines in these orders:

    P1: A (for D1), then E (for D2)        D1: B (from P2), then A (from P1)
    P2: C (for D2), then B (for D1)        D2: E (from P1), then C (from P2)

The prompts go first: P1 computes A and P2 computes C (their first tokens come back), and E and B queue
behind them for want of blocks. Then D1 reserves its blocks for B and asks P2 for it, D2 reserves its blocks
for E and asks P1, and each has its second request queued (KVHold: kept for --kv-hold-timeout, 600 s).
P1 keeps A for D1, which waits on B, queued on P2 behind C, which P2 keeps for D2, which waits on E,
queued on P1 behind A. No timeout ends that before 600 s (--kv-queue-timeout too). A prefill engine
that holds a prompt not asked for while a prompt a decode engine waits on cannot get blocks releases
the held one; its decode engine is answered kv_released when it asks, and computes the prompt itself.
Each prefill engine decides alone, as soon as its KVWant comes: both release (one would do, and the
other's held prompt is then asked for and moves, which the test accepts too). Without the breaker the
requests hang (checked by hand: D1's B and A still open after 30 s).

One router cannot make these orders: it sends each request to its prefill and its decode engine at once,
so every engine sees its requests in the router's order, and both roles admit first come first served.
The earliest unfinished request then always moves: nothing earlier holds blocks on its engines and nothing
later was admitted before it. Engines that serve two router replicas (`--router-address` twice) see each
replica's requests in orders of their own; the test sends as the replicas would, over the engines'
control sockets (pdserve.local_cluster.Driver), in the orders above.
"""

from __future__ import annotations

import time

from pdserve import LLM, SamplingParams
from pdserve.control.messages import GenerateRequest, PrefillRequest, TokenDelta
from pdserve.control.sampling_params import SamplingParams as WireSamplingParams
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import start_at_free_kv_addresses, stop_together

BLOCK = 4
ARGS = ("--block-size", str(BLOCK), "--max-num-batched-tokens", "64")
PROMPT_LEN, MAX_TOKENS = 48, 8
# One computed prompt (12 blocks) and 2 blocks more: a second prompt, or its first chunk beside the first
# prompt in one step (16 tokens), never fits.
PREFILL_BLOCKS = PROMPT_LEN // BLOCK + 2
# One request to its last token (14 blocks) and 2 blocks more: a second prompt never fits beside the first.
DECODE_BLOCKS = (PROMPT_LEN + MAX_TOKENS) // BLOCK + 2
# request -> (prefill engine, decode engine); the orders of the module's docstring
ROUTES = {"A": ("p1", "d1"), "B": ("p2", "d1"), "C": ("p2", "d2"), "E": ("p1", "d2")}
PREFILL_ORDER = ["A", "C", "E", "B"]  # P1: A, E; P2: C, B
DECODE_ORDER = ["B", "E", "A", "C"]  # D1: B, A; D2: E, C
HELD = {"p1": "A", "p2": "C"}  # the prompt each prefill engine computes first and keeps
PROMPTS = {name: [(7 * i + j) % 200 + 3 for j in range(PROMPT_LEN)] for i, name in enumerate(sorted(ROUTES))}
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
TIMEOUT_S = 30  # the cycle broken takes a few seconds; unbroken it lasts 600 s


def _expected(model_dir: str) -> dict[str, list[int]]:
    """Each request's greedy tokens, computed one at a time in the offline engine."""
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    params = SamplingParams(**GREEDY)
    return {name: llm.generate([{"prompt_token_ids": PROMPTS[name]}], params)[0].outputs[0].token_ids
            for name in sorted(ROUTES)}


def _wait_first_tokens(drivers: list[Driver], request_ids: set[str]) -> None:
    """Until each prefill engine has sent the first token of these requests (their prompts are computed)."""
    deadline = time.monotonic() + TIMEOUT_S
    while request_ids:
        assert time.monotonic() < deadline, f"prompts never computed: {sorted(request_ids)}"
        for driver in drivers:
            received = driver.prefill.recv(timeout=0.01)
            if received is not None and isinstance(received.msg, TokenDelta):
                assert received.msg.finish_reason != "error", received.msg
                request_ids.discard(received.msg.request_id)


def _send_in_cycle_order(drivers: dict[str, Driver], prefill_kv: dict[str, str]) -> None:
    """The prompts to the prefill engines, and once the first of each is computed, the requests to the decode
    engines. drivers: by decode engine, each with the prefill engine of its number; a prefill engine's first
    tokens come back to the driver that sent the prompt (collect() ignores them: the decode engine sends
    every token)."""
    params = WireSamplingParams(**GREEDY)
    by_prefill = {driver.prefill_kv: driver for driver in drivers.values()}
    for name in PREFILL_ORDER:
        prefill, _ = ROUTES[name]
        by_prefill[prefill_kv[prefill]].prefill.send(
            PrefillRequest(request_id=name, prompt_token_ids=PROMPTS[name], sampling_params=params))
    _wait_first_tokens(list(drivers.values()), set(HELD.values()))
    for name in DECODE_ORDER:
        prefill, decode = ROUTES[name]
        drivers[decode].decode.send(GenerateRequest(request_id=name, prompt_token_ids=PROMPTS[name],
                                                    sampling_params=params, prefill_kv_address=prefill_kv[prefill]))


def test_a_cycle_of_held_prompts_across_two_prefill_engines_is_broken(tiny_model, tmp_path):
    expected = _expected(tiny_model)
    engines: dict[str, EngineProcess] = {}
    drivers: dict[str, Driver] = {}
    try:
        def prefill(index: int):
            return lambda kv: EngineProcess("prefill", tiny_model, *ARGS, "--num-kv-blocks", str(PREFILL_BLOCKS),
                                            "--engine-id", f"p{index + 1}", "--kv-address", kv[index],
                                            log_dir=tmp_path)

        def decode(name: str):
            return lambda kv: EngineProcess("decode", tiny_model, *ARGS, "--num-kv-blocks", str(DECODE_BLOCKS),
                                            "--engine-id", name, "--kv-peer", kv[0], "--kv-peer", kv[1],
                                            log_dir=tmp_path)

        engines = dict(zip(("p1", "p2", "d1", "d2"),
                           start_at_free_kv_addresses(2, prefill(0), prefill(1), decode("d1"), decode("d2"))))
        drivers = {"d1": Driver(engines["d1"], engines["p1"]), "d2": Driver(engines["d2"], engines["p2"])}
        prefill_kv = {name: engines[name].addresses["kv"] for name in ("p1", "p2")}

        _send_in_cycle_order(drivers, prefill_kv)
        results = {}
        for decode, driver in drivers.items():
            results.update(driver.collect([name for name in DECODE_ORDER if ROUTES[name][1] == decode],
                                          timeout_s=TIMEOUT_S))

        assert {name: result.token_ids for name, result in results.items()} == expected
        assert all(result.finish_reason == "length" for result in results.values()), results
        released = {held for prefill, held in HELD.items()
                    if f"released the KV of {held} (not asked for yet)" in engines[prefill].log()}
        assert released, "the requests completed, so a prefill engine released its held prompt"
        for decode, prefill in (("d1", "p1"), ("d2", "p2")):
            decode_stats, prefill_stats = drivers[decode].wait_idle()
            assert decode_stats.kv_blocks_used == 0 and prefill_stats.kv_blocks_used == 0, "no block leaked"
            assert decode_stats.num_running == decode_stats.num_waiting == decode_stats.num_waiting_for_remote_kv == 0
            # a prefill engine released at most its held prompt; its other prompt moved
            num_released = int(HELD[prefill] in released)
            assert prefill_stats.num_kv_transfers_failed == num_released
            assert prefill_stats.num_kv_transfers == 2 - num_released
            # the decode engine that asked for it was told so, and computed it itself (D1 asks for P1's A, D2 for
            # P2's C); its other prompt's KV came
            assert decode_stats.num_kv_transfers_failed == num_released
            assert decode_stats.num_kv_transfers == 2 - num_released
            told = "released for a prompt that a decode engine was waiting on" in engines[decode].log()
            assert told == bool(num_released)
    finally:
        for driver in drivers.values():
            driver.close()
        stop_together(*engines.values())
