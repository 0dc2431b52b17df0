"""kill -9 of a dual-role engine in the middle of a KV transfer, in either role: the peer ends every
request (recomputing what it cannot pull) and holds no KV block afterwards."""

from __future__ import annotations

import signal
import time

import pytest

from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, assert_no_leaks, colocated_tokens
from tests.decode.test_disaggregated import start_at_free_kv_addresses, stop_together
from tests.decode.test_faults import KV_TIMEOUT, wait_for_log, wait_prefill_idle

FAULTY = {"module": "tests.decode.faulty_prefill"}  # its KV sender misbehaves (tests/decode/faulty_prefill.py)


@pytest.fixture(scope="module")
def expected(model_factory):
    return colocated_tokens(model_factory("llama"), PROMPTS[:3], **GREEDY)


def start_pair(model_dir: str, tmp_path, fault: str, *x_args: str) -> tuple[EngineProcess, EngineProcess, Driver]:
    """X, a dual engine whose KV sender acts out `fault`, and Y, a dual engine that pulls from it; three prompts
    sent, X prefilling them for Y."""
    x, y = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("engine", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], "--kv-streaming", "on",
                                    "--fault", fault, *x_args, log_dir=tmp_path, **FAULTY),
        lambda kv: EngineProcess("engine", model_dir, *ENGINE_ARGS, *KV_TIMEOUT, "--kv-peer", kv[0], log_dir=tmp_path))
    driver = Driver(y, x)
    for i, prompt in enumerate(PROMPTS[:3]):
        driver.submit(f"r{i}", prompt, **GREEDY)
    return x, y, driver


def test_killing_the_dual_engine_that_prefills_leaves_its_decode_peer_clean(model_factory, tmp_path, expected):
    """X prefills for Y and hangs inside its first KV send; X is killed. Y recomputes the prompts itself
    within its KV timeout, decodes them, and frees everything."""
    x, y, driver = start_pair(model_factory("llama"), tmp_path, "stall:0")
    try:
        wait_for_log(x, "stalling forever mid-transfer")
        assert driver.decode_stats().num_waiting_for_remote_kv >= 1, "Y waits for the KV X is sending"
        x.kill()
        started = time.monotonic()
        results = driver.collect([f"r{i}" for i in range(3)], timeout_s=30)
        assert time.monotonic() - started < 15, "requests end within Y's KV timeout, not hang"
        assert [r.token_ids for r in results.values()] == expected
        driver.prefill = None  # X is dead: check Y alone
        assert driver.decode_stats().num_kv_transfers_failed >= 1
        assert_no_leaks(driver)
        assert [r.token_ids for r in driver.generate(PROMPTS[:3], remote=False, prefix="after", **GREEDY)] == expected
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(x, y)


def test_killing_the_dual_engine_that_decodes_leaves_its_prefill_peer_clean(model_factory, tmp_path, expected):
    """Y pulls from X, which holds the prompts' KV in a slow send when Y is killed. X frees every block
    within its lease / KVWant bounds and keeps serving, in both roles."""
    x, y, driver = start_pair(model_factory("llama"), tmp_path, "delay:0", "--kv-lease", "2", "--kv-want-timeout", "2")
    try:
        wait_for_log(x, "delaying a KV send")
        assert driver.prefill_stats().kv_blocks_used > 0
        y.process.send_signal(signal.SIGKILL)
        started = time.monotonic()
        stats = wait_prefill_idle(driver, timeout_s=15)
        assert stats.kv_blocks_used == 0, f"X still holds {stats.kv_blocks_used} blocks"
        assert time.monotonic() - started < 10 and stats.num_running == stats.num_waiting == 0
        y.kill()
        local = Driver(x)  # X decodes now, colocated
        try:
            assert [r.token_ids for r in local.generate(PROMPTS[:3], remote=False, **GREEDY)] == expected
            assert_no_leaks(local)
        finally:
            local.close()
    finally:
        driver.close()
        stop_together(x, y)


def test_abort_during_a_transfer_between_dual_engines_frees_both(model_factory, tmp_path, expected):
    x, y, driver = start_pair(model_factory("llama"), tmp_path, "delay:0")
    try:
        wait_for_log(x, "delaying a KV send")  # X is inside a 2 s delayed send; Y waits for the KV
        for i in range(3):
            driver.abort(f"r{i}")
        results = driver.collect([f"r{i}" for i in range(3)], timeout_s=15)
        reasons = {r.finish_reason for r in results.values()}
        assert "abort" in reasons and reasons <= {"abort", "length"}, reasons  # one may have ended first
        assert_no_leaks(driver)
        after = driver.generate(PROMPTS[:3], prefix="after", **GREEDY)  # both keep serving, X still prefilling
        assert [r.token_ids for r in after] == expected
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(x, y)
