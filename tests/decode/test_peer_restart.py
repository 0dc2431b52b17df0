"""A prefill engine killed with SIGKILL and started again on the same KV address is a new peer: the decode
engine's link to it says Hello again, and the next requests take about as long as they did before the kill
(not the KV timeout each, as when the restarted engine answered every KVWant with `no_hello`)."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from pdserve.control.sockets import ClientSocket
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, assert_no_leaks, colocated_tokens
from tests.decode.test_disaggregated import free_kv_addresses, start_together, stop_together
from tests.router.test_migration_up import DEEP_LAYERS

pytestmark = pytest.mark.hostile

NUM_REQUESTS = 8  # the stale link made every request after the restart wait out the KV timeout
SAMPLING = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
# what a stale link cost before: each request waited out the decode engine's KV timeout
KV_TIMEOUT_S = 30
DECODE_ARGS = ("--kv-timeout", str(KV_TIMEOUT_S), "--kv-queue-timeout", str(KV_TIMEOUT_S))


def prompts(seed: int) -> list[list[int]]:
    """NUM_REQUESTS random 40-token prompts (the tiny model's vocabulary has 1,024 tokens). The same ones run
    before the kill and after: each request's bound is its own unloaded time."""
    draw = random.Random(seed)
    return [[draw.randrange(10, 1000) for _ in range(40)] for _ in range(NUM_REQUESTS)]


def timed_one_by_one(driver: Driver, prompt_set: list[list[int]], prefix: str,
                     ) -> tuple[list[list[int]], list[float]]:
    """Each prompt alone (unloaded), in order: its tokens and its end-to-end seconds."""
    tokens, seconds = [], []
    for i, prompt in enumerate(prompt_set):
        started = time.monotonic()
        driver.submit(f"{prefix}{i}", prompt, **SAMPLING)
        result = driver.collect([f"{prefix}{i}"], timeout_s=90)[f"{prefix}{i}"]
        seconds.append(time.monotonic() - started)
        assert result.finish_reason == "length", result.error
        assert seconds[-1] < KV_TIMEOUT_S, f"request {prefix}{i} waited out the KV timeout\n{failed_transfers(driver)}"
        tokens.append(result.token_ids)
    return tokens, seconds


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(0.05)


def failed_transfers(driver: Driver) -> str:
    """The decode engine's log lines about failed transfers."""
    return "\n".join(line for line in driver.decode_log().splitlines() if "remote prefill" in line)[-3000:]


def start_prefill(model_dir: str, tmp_path, control: str, kv: str) -> EngineProcess:
    return EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-streaming", "on", "--control-address", control,
                         "--kv-address", kv, log_dir=tmp_path)


def test_prefill_restarted_on_its_address_is_served_at_once(model_factory, tmp_path):
    """2P1D without a router: P_a is killed and started again on its addresses; P_b is never touched. Each
    request through the restarted P_a is bracketed by a request of the same length through P_b, the unloaded
    time of that moment (the shared machine's load drifts too much for a time measured minutes apart)."""
    model_dir = model_factory("llama")
    control, kv, other_kv = free_kv_addresses(3)
    prefill, other, decode = start_together(  # at once: every address is known before any starts
        lambda: start_prefill(model_dir, tmp_path, control, kv),
        lambda: start_prefill(model_dir, tmp_path, "tcp://127.0.0.1:0", other_kv),
        lambda: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv, "--kv-peer", other_kv, *DECODE_ARGS,
                              log_dir=tmp_path))
    driver, reference = Driver(decode, prefill), Driver(decode, other)
    try:
        timed_one_by_one(driver, prompts(0)[:3], "warm")
        timed_one_by_one(reference, prompts(0)[:3], "warm")
        expected, _ = timed_one_by_one(driver, prompts(1), "before")

        prefill.kill()  # SIGKILL by its PID
        prefill = start_prefill(model_dir, tmp_path, control, kv)  # same control and KV addresses
        driver.engines = (decode, prefill)
        tokens, after, unloaded = [], [], []
        reference_prompts = prompts(2)
        for i, prompt in enumerate(prompts(1)):
            before_s = timed_one_by_one(reference, [reference_prompts[i]], f"ref{i}-")[1][0]
            result, seconds = timed_one_by_one(driver, [prompt], f"after{i}-")
            after_s = timed_one_by_one(reference, [reference_prompts[i]], f"ref{i}+")[1][0]
            tokens += result
            after += seconds
            unloaded.append(max(before_s, after_s))

        ratios = [a / u for a, u in zip(after, unloaded)]
        print(f"\nthe {NUM_REQUESTS} requests after the restart: median {statistics.median(after):.3f}s, max "
              f"{max(after):.3f}s; unloaded (bracketing) median {statistics.median(unloaded):.3f}s; after / unloaded: "
              f"median {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
        # The fault this guards against made every request wait out a 30 s timeout (about 100x); one request
        # of a busy host can take 2x its bracket by itself (0.60 s against 0.27 s in a CI-like run), so the
        # median is held to 2x and each request to 10x.
        slow = {i: f"{a:.2f}s > 10 x {u:.2f}s" for i, (a, u) in enumerate(zip(after, unloaded)) if a > 10 * u}
        assert not slow, f"requests after the restart over 10x their unloaded time: {slow}\n{failed_transfers(driver)}"
        assert statistics.median(ratios) <= 2, f"after / unloaded median {statistics.median(ratios):.2f} > 2"
        assert tokens == expected, "greedy output changed"
        assert driver.prefill_stats().num_kv_transfers == NUM_REQUESTS, "every request took its KV from the new P_a"
        assert_no_leaks(driver)
        assert_no_leaks(reference)
    finally:
        driver.close()
        reference.close()
        stop_together(prefill, other, decode)


def test_prefill_frees_at_once_what_it_held_for_a_killed_decode_engine(model_factory, tmp_path):
    """D runs one request at a time, so P holds the computed prompts of those queued behind it for D's KVWant
    (KVHold: up to --kv-hold-timeout, 600 s). D is killed and started again with the same engine id: its Hello
    with a new incarnation tells P, which frees those blocks at once. The tiny model is 16 layers deep here: the
    busy request's 400 tokens of the 2-layer one could end before the kill on a busy host, and D would then pull
    the queued prompts (P would hold nothing for it)."""
    model_dir = model_factory("llama", num_hidden_layers=DEEP_LAYERS)
    decode_control, kv = free_kv_addresses(2)
    decode_args = (*ENGINE_ARGS, "--max-num-seqs", "1", "--engine-id", "d0", "--control-address", decode_control,
                   "--kv-peer", kv)
    prefill, decode = start_together(
        lambda: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-streaming", "on", "--kv-address", kv,
                              log_dir=tmp_path),
        lambda: EngineProcess("decode", model_dir, *decode_args, log_dir=tmp_path))
    driver = Driver(decode, prefill)
    try:
        busy, *queued = prompts(3)[:4]
        driver.submit("busy", busy, remote=False, temperature=0.0, max_tokens=400, ignore_eos=True)
        wait_for(lambda: driver.decode_stats().num_running == 1, "D runs its one request")
        for i, prompt in enumerate(queued):  # queued behind it on D, which holds them on P (KVHold)
            driver.submit(f"r{i}", prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
        computed = 3 * 10  # 40-token prompts in blocks of 4
        wait_for(lambda: driver.prefill_stats().kv_blocks_used >= computed, "P holds the prompts D has queued")
        held = driver.prefill_stats().kv_blocks_used

        old_log = decode.log()
        decode.kill()  # SIGKILL by its PID
        decode = EngineProcess("decode", model_dir, *decode_args, log_dir=tmp_path)
        started = time.monotonic()
        while driver.prefill_stats().kv_blocks_used > 0:
            assert time.monotonic() - started < 5, (f"P still holds {driver.prefill_stats().kv_blocks_used} blocks:\n"
                                                    f"{prefill.log()[-6000:]}\n{old_log[-3000:]}")
            time.sleep(0.05)
        print(f"\nP held {held} blocks for the killed D; free {time.monotonic() - started:.2f}s after D restarted")
        assert "decode engine d0 restarted" in prefill.log()
        driver.decode.close()
        driver.decode = ClientSocket(decode.addresses["control"])
        driver.engines = (decode, prefill)
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(prefill, decode)


def test_transfers_in_flight_when_prefill_dies_fail_at_once_and_its_restart_is_used(model_factory, tmp_path):
    """P hangs inside a KV send (tests/decode/faulty_prefill.py) with three transfers asked, and is killed: the
    link's connection drops, so D recomputes the three at once instead of after --kv-timeout (30 s here). P then
    comes back on its addresses and serves the next request's KV."""
    model_dir = model_factory("llama")
    control, kv = free_kv_addresses(2)
    prefill, decode = start_together(
        lambda: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-streaming", "on", "--control-address", control,
                              "--kv-address", kv, "--fault", "stall:0", module="tests.decode.faulty_prefill",
                              log_dir=tmp_path),
        lambda: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv, *DECODE_ARGS, log_dir=tmp_path))
    driver = Driver(decode, prefill)
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            driver.submit(f"r{i}", prompt, **GREEDY)
        wait_for(lambda: "stalling forever mid-transfer" in prefill.log(), "P stalls inside a KV send")
        prefill.kill()  # SIGKILL by its PID
        killed = time.monotonic()
        results = driver.collect([f"r{i}" for i in range(3)], timeout_s=60)
        recovered_s = time.monotonic() - killed
        print(f"\nthree transfers in flight when P was killed: all answered {recovered_s:.2f}s after the kill")
        assert recovered_s < KV_TIMEOUT_S / 3, f"{recovered_s:.1f}s: the transfers waited for a timeout"
        expected = colocated_tokens(model_dir, PROMPTS[:4], **GREEDY)
        assert [results[f"r{i}"].token_ids for i in range(3)] == expected[:3]
        assert "dropped" in failed_transfers(driver)

        prefill = start_prefill(model_dir, tmp_path, control, kv)
        driver.engines = (decode, prefill)
        assert driver.generate([PROMPTS[3]], prefix="next", **GREEDY)[0].token_ids == expected[3]
        assert driver.prefill_stats().num_kv_transfers == 1, "the restarted P served the KV"
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(prefill, decode)
