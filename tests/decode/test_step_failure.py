"""A step that raises inside a real engine process (tests/decode/faulty_sampler.py): the requests of
that step end with a clear error, the engine logs the traceback, frees their blocks and keeps serving."""

from __future__ import annotations

from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.faulty_sampler import FAULT_SEED
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, assert_no_leaks, colocated_tokens
from tests.decode.test_disaggregated import start_at_free_kv_addresses, stop_together


def test_a_failing_step_fails_its_request_and_the_engine_keeps_serving(model_factory, tmp_path):
    model_dir = model_factory("llama")
    decode = EngineProcess("decode", model_dir, *ENGINE_ARGS, log_dir=tmp_path, module="tests.decode.faulty_sampler")
    driver = Driver(decode)
    try:
        bad, = driver.generate([PROMPTS[1]], remote=False, prefix="bad", temperature=1.0, seed=FAULT_SEED,
                               max_tokens=8)
        assert bad.finish_reason == "error" and bad.token_ids == []
        assert "engine failed while running this request" in bad.error and "injected sampler fault" in bad.error
        log = decode.log()
        assert "Traceback" in log and "injected sampler fault" in log, "the engine logs what went wrong"
        assert decode.process.poll() is None, "the engine process is still running"
        assert_no_leaks(driver)
        results = driver.generate(PROMPTS[:3], remote=False, prefix="good", **GREEDY)
        assert [r.token_ids for r in results] == colocated_tokens(model_dir, PROMPTS[:3], **GREEDY)
        assert all(r.finish_reason == "length" for r in results)
        assert_no_leaks(driver)
    finally:
        driver.close()
        decode.stop()


def test_a_prefill_step_that_fails_mid_stream_frees_both_engines(model_factory, tmp_path):
    """The prefill engine streams a prompt's KV layer by layer, then its sampler raises: the request
    fails (the router would abort it on decode, as here), and both engines go on without leaks."""
    model_dir = model_factory("llama")
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], "--kv-streaming", "on",
                                    log_dir=tmp_path, module="tests.decode.faulty_sampler"),
        lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-timeout", "4", "--kv-queue-timeout", "4",
                                 "--kv-peer", kv[0], log_dir=tmp_path))
    driver = Driver(decode, prefill)
    try:
        bad, = driver.generate([PROMPTS[4]], prefix="bad", temperature=1.0, seed=FAULT_SEED, max_tokens=8)
        assert bad.finish_reason == "error" and "injected sampler fault" in bad.error
        driver.abort("bad0")
        assert driver.collect(["bad0"])["bad0"].finish_reason == "abort", "the decode engine ends it too"
        results = driver.generate(PROMPTS[:3], prefix="good", **GREEDY)
        assert [r.token_ids for r in results] == colocated_tokens(model_dir, PROMPTS[:3], **GREEDY)
        assert prefill.process.poll() is None and decode.process.poll() is None
        assert_no_leaks(driver)
    finally:
        driver.close()
        stop_together(prefill, decode)
