"""A computed prompt's KV does not wait for the prefill engine's next step to end: with layer streaming
off (the CPU default), a KVWant that arrives while a long step runs is answered at that step's layer
boundaries. Real engine processes; the order of events comes from the engines' own DEBUG timestamps."""

from __future__ import annotations

import re
import time

from pdserve.control.messages import GenerateRequest, PrefillRequest, TokenDelta
from pdserve.control.sampling_params import SamplingParams
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import assert_no_leaks, start_at_free_kv_addresses, stop_together
from tests.decode.test_first_token import DEBUG, _times

# A model and prompt whose prefill is one step of a second or more on a CPU core.
LONG_STEP_MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8,
                   "max_position_embeddings": 4096}
LONG_PROMPT = [5 + (i * 7) % 1000 for i in range(1024)]
SHORT_PROMPT = list(range(10, 30))
ENGINE_ARGS = ("--block-size", "16", "--num-kv-blocks", "300", "--max-num-batched-tokens", "1024", *DEBUG)
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _first_token(driver: Driver, request_id: str, timeout_s: float = 60.0) -> None:
    """Wait for the prefill engine's first token of `request_id` (its prompt is then computed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        received = driver.prefill.recv(timeout=0.1)
        if received is not None and isinstance(received.msg, TokenDelta) and received.msg.request_id == request_id:
            assert received.msg.token_ids, f"no first token for {request_id}: {received.msg.error}"
            return
    raise TimeoutError(f"no first token of {request_id} within {timeout_s}s")


def _wait_for_log(engine: EngineProcess, pattern: str, timeout_s: float = 60.0) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, engine.log())
        if found:
            return found
        time.sleep(0.01)
    raise TimeoutError(f"no log line {pattern!r} within {timeout_s}s:\n{engine.log()[-2000:]}")


def _generate(driver: Driver, request_id: str, prompt: list[int]) -> None:
    driver.decode.send(GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=PARAMS,
                                       prefill_kv_address=driver.prefill_kv))


def test_a_kvwant_during_a_long_step_is_answered_before_the_step_ends(model_factory, tmp_path):
    model_dir = model_factory("llama", **LONG_STEP_MODEL)
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], "--kv-streaming", "off",
                                    log_dir=tmp_path),
        lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv[0], log_dir=tmp_path))
    driver = Driver(decode, prefill)
    try:
        # "early" is computed first: its KV waits on the prefill engine for the decode engine's KVWant.
        driver.prefill.send(PrefillRequest(request_id="early", prompt_token_ids=SHORT_PROMPT, sampling_params=PARAMS))
        _first_token(driver, "early")
        # Then a long prompt's step begins, and only then does the decode engine take "early" and ask.
        driver.prefill.send(PrefillRequest(request_id="long", prompt_token_ids=LONG_PROMPT, sampling_params=PARAMS))
        began = float(_wait_for_log(prefill, r"prompt chunks of long\) began at ([\d.]+)").group(1))
        asked_after = time.time()
        _generate(driver, "early", SHORT_PROMPT)
        assert driver.collect(["early"])["early"].finish_reason == "length"
        _generate(driver, "long", LONG_PROMPT)
        assert driver.collect(["long"])["long"].finish_reason == "length"
        assert_no_leaks(driver)
        ended = float(_wait_for_log(prefill, r"prompt chunks of long\) ended at ([\d.]+)").group(1))
        verified = _times(decode.log(), r"KV of (\S+) verified at ([\d.]+)")
    finally:
        driver.close()
        stop_together(prefill, decode)
    assert began < asked_after < ended, (
        f"the long step ({ended - began:.2f}s) ended before the KVWant could be sent: make it longer")
    assert verified["early"] < ended, (
        f"early's KV was verified {verified['early'] - ended:.3f}s after the step running when it was asked for "
        "ended: the KVWant waited for the step")
