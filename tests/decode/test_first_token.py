"""The first token leaves the prefill engine before its KV: by the engines' own clocks, P publishes it
before D has verified the transfer (KV streamed or sent after the prefill), and a decode engine that
prefills the prompt itself keeps the first token it was given (FirstToken) instead of its own sample."""

from __future__ import annotations

import re

import pytest

from pdserve import SamplingParams
from pdserve.control.messages import FirstToken
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import (
    ENGINE_ARGS,
    GREEDY,
    PROMPTS,
    assert_no_leaks,
    colocated_llm,
    colocated_outputs,
    running_pair,
)

DEBUG = ("--log-level", "DEBUG")


def _times(log: str, pattern: str) -> dict[str, float]:
    """{request id: timestamp} of the engine log lines `pattern` ("... of (id) ... at (t)") matches."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, log)}


@pytest.mark.parametrize("streaming", ["on", "off"])
def test_the_first_token_is_published_before_the_transfer_completes(model_factory, tmp_path, streaming):
    model_dir = model_factory("llama")
    with running_pair(model_dir, tmp_path, prefill_args=("--kv-streaming", streaming, *DEBUG),
                      decode_args=DEBUG) as driver:
        expected = colocated_outputs(colocated_llm(model_dir), PROMPTS, **GREEDY)
        assert [r.token_ids for r in driver.generate(PROMPTS, **GREEDY)] == [e.token_ids for e in expected]
        assert_no_leaks(driver)
        published = _times(driver.prefill_log(), r"first token of (\S+) published at ([\d.]+)")
        verified = _times(driver.decode_log(), r"KV of (\S+) verified at ([\d.]+)")
    assert set(published) == set(verified) == {f"r{i}" for i in range(len(PROMPTS))}
    for request_id, at in published.items():
        assert at < verified[request_id], f"{request_id}: first token after its KV was verified"


def test_a_local_prefill_keeps_the_first_token_it_was_given(model_factory, tmp_path):
    """Greedy would pick another token; the decode engine emits the given one and continues from it
    exactly as the offline engine continues prompt + that token."""
    model_dir = model_factory("llama")
    llm = colocated_llm(model_dir)
    prompt = PROMPTS[4]  # chunked: the FirstToken is in before the last chunk samples
    sampled = colocated_outputs(llm, [prompt], **GREEDY)[0].token_ids[0]
    given = (sampled + 1) % 100
    continued = colocated_outputs(llm, [prompt + [given]], **{**GREEDY, "max_tokens": GREEDY["max_tokens"] - 1})[0]
    decode = EngineProcess("decode", model_dir, *ENGINE_ARGS, log_dir=tmp_path)
    driver = Driver(decode)
    try:
        driver.submit("kept", prompt, remote=False, **GREEDY)
        driver.decode.send(FirstToken(request_id="kept", token_id=given, logprobs=None))
        result = driver.collect(["kept"])["kept"]
        assert result.token_ids == [given, *continued.token_ids]
        assert_no_leaks(driver)
    finally:
        driver.close()
        decode.stop()


PROMPT_LOGPROBS = {**GREEDY, "prompt_logprobs": 2}


def assert_same_prompt_logprobs(theirs, ours_offline) -> None:
    """The wire's {id: (logprob, rank)} rows against the offline engine's {id: logprob} rows."""
    assert theirs is not None and len(theirs) == len(ours_offline) and theirs[0] is None
    for wire, offline in zip(theirs[1:], ours_offline[1:]):
        assert list(wire) == list(offline)
        for token_id, (logprob, rank) in wire.items():
            assert logprob == pytest.approx(offline[token_id], rel=1e-5, abs=1e-5)  # float32 over other batches
            assert rank >= 1


def test_prompt_logprobs_come_from_whichever_engine_runs_the_prompt(model_factory, tmp_path):
    """Disaggregated: the prefill engine sends them (the decode engine, which only receives KV, sends
    none); prefilled locally, the decode engine does. Both equal the offline engine's."""
    model_dir = model_factory("llama")
    offline = colocated_llm(model_dir).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                SamplingParams(**PROMPT_LOGPROBS))
    with running_pair(model_dir, tmp_path) as driver:
        for remote, engine in [(True, "prefill"), (False, "decode")]:
            results = driver.generate(PROMPTS, remote=remote, prefix=engine, **PROMPT_LOGPROBS)
            for prompt, result, expected in zip(PROMPTS, results, offline):
                assert result.token_ids == expected.outputs[0].token_ids, (result.finish_reason, result.error)
                if len(prompt) == 1:  # no position has a logprob: nothing is sent
                    assert result.prompt_logprobs is None
                    continue
                assert result.prompt_logprobs_from == engine
                assert_same_prompt_logprobs(result.prompt_logprobs, expected.prompt_logprobs)
        assert_no_leaks(driver)
