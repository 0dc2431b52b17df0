"""Failures of the prefill engine or the KV link: every request still ends (recomputed locally or a
clear error) within its timeout, and no KV block leaks on either engine."""

from __future__ import annotations

import signal
import time

import pytest

from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import (
    ENGINE_ARGS,
    GREEDY,
    PROMPTS,
    assert_no_leaks,
    colocated_tokens,
)
from tests.decode.test_disaggregated import start_at_free_kv_addresses, stop_together

KV_TIMEOUT = ("--kv-timeout", "4", "--kv-queue-timeout", "4")  # no router: no FirstToken either


@pytest.fixture(scope="module")
def expected(model_factory):
    return colocated_tokens(model_factory("llama"), PROMPTS[:3], **GREEDY)


def run_pair(model_factory, tmp_path, fault=None, decode_args=KV_TIMEOUT, prefill_model=None, prefill_args=()):
    """fault: "drop:0" etc., acted out by the prefill engine's KV sender (tests/decode/faulty_prefill.py)."""
    model_dir = model_factory("llama")
    launch = {"module": "tests.decode.faulty_prefill"} if fault else {}
    fault_args = ("--fault", fault) if fault else ()
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", prefill_model or model_dir, *ENGINE_ARGS, "--kv-address", kv[0],
                                    "--kv-streaming", "on", *prefill_args, *fault_args, log_dir=tmp_path, **launch),
        lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv[0], *decode_args, log_dir=tmp_path))
    return prefill, decode, Driver(decode, prefill)


def wait_for_log(process: EngineProcess, text: str, timeout_s: float = 20.0) -> None:
    """Until the engine's log holds `text` (a fault injection announces itself before it acts)."""
    deadline = time.monotonic() + timeout_s
    while text not in process.log():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} not in the {process.role} engine's log after {timeout_s}s")
        time.sleep(0.02)


def shutdown(driver, *processes):
    driver.close()
    stop_together(*processes)


@pytest.mark.parametrize("fault, reason", [("drop:0", "incomplete"), ("corrupt:1", "checksum")])
def test_lost_or_corrupt_kv_is_recomputed(model_factory, tmp_path, expected, fault, reason):
    prefill, decode, driver = run_pair(model_factory, tmp_path, fault)
    try:
        results = driver.generate(PROMPTS[:3], **GREEDY)
        assert [r.token_ids for r in results] == expected
        assert driver.decode_stats().num_kv_transfers_failed == 1
        assert reason in decode.log(), "the decode engine logs why the transfer failed"
        assert_no_leaks(driver)
    finally:
        shutdown(driver, prefill, decode)


def test_prefill_killed_mid_transfer(model_factory, tmp_path, expected):
    prefill, decode, driver = run_pair(model_factory, tmp_path, "stall:0")
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            driver.submit(f"r{i}", prompt, **GREEDY)
        wait_for_log(prefill, "stalling forever mid-transfer")
        assert driver.decode_stats().num_waiting_for_remote_kv >= 1, "D waits for the KV P is sending"
        prefill.kill()  # kill -9 while it is stuck inside the first KV send
        started = time.monotonic()
        results = driver.collect([f"r{i}" for i in range(3)], timeout_s=30)
        assert time.monotonic() - started < 15, "requests must end within the KV timeout, not hang"
        assert [r.token_ids for r in results.values()] == expected
        assert driver.decode_stats().num_kv_transfers_failed >= 1, "the transfer under way failed, then recomputed"
        driver.prefill = None  # it is dead; check the decode side only
        assert_no_leaks(driver)
    finally:
        shutdown(driver, prefill, decode)


def test_wrong_fingerprint_refuses_link_with_clear_error(model_factory, tmp_path):
    """P (other weights) refuses D's link: D fails the requests at once with the reason; P, which was
    never asked for the KV it computed, frees it when its 2 s KVWant wait runs out."""
    other_weights = model_factory("llama", seed=1)
    prefill, decode, driver = run_pair(model_factory, tmp_path, decode_args=(*KV_TIMEOUT, "--kv-failure", "fail"),
                                       prefill_model=other_weights, prefill_args=("--kv-want-timeout", "2"))
    try:
        started = time.monotonic()
        results = driver.generate(PROMPTS[:2], **GREEDY)
        assert time.monotonic() - started < 4, "a refused link fails the requests before the 4 s KV timeout"
        for result in results:
            assert result.finish_reason == "error"
            assert "refused the KV link" in result.error and "weights_hash" in result.error
        assert "refused KV link" in prefill.log()
        _, prefill_stats = driver.wait_idle(timeout_s=10)
        assert prefill_stats.kv_blocks_used == 0 and time.monotonic() - started < 2 + 4, "freed within the KVWant wait"
        assert_no_leaks(driver)
    finally:
        shutdown(driver, prefill, decode)


def test_abort_during_transfer_frees_both_sides(model_factory, tmp_path):
    prefill, decode, driver = run_pair(model_factory, tmp_path, "delay:0")
    try:
        driver.submit("slow", PROMPTS[1], **GREEDY)
        wait_for_log(prefill, "delaying a KV send")  # P is inside the 2 s delayed send; D waits for the KV
        assert driver.decode_stats().num_waiting_for_remote_kv == 1
        driver.abort("slow")
        results = driver.collect(["slow"], timeout_s=15)
        assert results["slow"].finish_reason == "abort"
        assert_no_leaks(driver)
        # the engines keep serving afterwards
        assert driver.generate([PROMPTS[0]], prefix="after", **GREEDY)[0].finish_reason == "length"
        assert_no_leaks(driver)
    finally:
        shutdown(driver, prefill, decode)



def wait_prefill_idle(driver, timeout_s: float):
    """Poll the prefill engine alone (its decode engine is gone) until it holds no KV block."""
    deadline = time.monotonic() + timeout_s
    stats = driver.prefill_stats()
    while stats.kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = driver.prefill_stats()
    return stats


@pytest.mark.parametrize("failure", ["killed", "frozen"])
def test_prefill_frees_its_blocks_when_decode_dies_or_hangs(model_factory, tmp_path, expected, failure):
    """D is killed (-9) or frozen (SIGSTOP: its sockets stay open, it never acks) while P holds the
    prompts' KV for it. P frees every block within its bounds (a send to the gone peer fails, or the
    2 s ack lease / KVWant wait runs out) and keeps serving another decode engine."""
    prefill, decode, driver = run_pair(model_factory, tmp_path, "delay:0",
                                       prefill_args=("--kv-lease", "2", "--kv-want-timeout", "2"))
    replacement = None
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            driver.submit(f"r{i}", prompt, **GREEDY)
        wait_for_log(prefill, "delaying a KV send")  # D asked for the KV; P holds the blocks in its delayed send
        assert driver.prefill_stats().kv_blocks_used > 0
        decode.process.send_signal(signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        stats = wait_prefill_idle(driver, timeout_s=15)
        assert stats.kv_blocks_used == 0, f"prefill engine still holds {stats.kv_blocks_used} blocks"
        assert time.monotonic() - started < 10, "P must free within its lease / KVWant bounds"
        assert stats.num_running == stats.num_waiting == 0
        decode.kill()
        replacement = EngineProcess("decode", model_factory("llama"), *ENGINE_ARGS, *KV_TIMEOUT,
                                    *prefill.kv_peer_args(), log_dir=tmp_path)
        driver.close()
        driver = Driver(replacement, prefill)
        results = driver.generate(PROMPTS[:3], prefix="after", **GREEDY)
        assert [r.token_ids for r in results] == expected
        assert driver.decode_stats().num_kv_transfers_failed == 0
        assert_no_leaks(driver)
    finally:
        shutdown(driver, *filter(None, (prefill, decode, replacement)))
