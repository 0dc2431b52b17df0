"""The served-step profile: its clock's bookkeeping, its breakdown's check, and the whole harness at toy size
(`pdserve up` 1P1D with CURVE, a tiny model, a few requests): the breakdown's parts add up to the step."""

from __future__ import annotations

import json
import time

import pytest

from tests.experiments import load_experiment

step_spans = load_experiment("step_spans")
report = load_experiment("serve_profile_report")


class Plan:
    is_empty = False
    num_decodes = num_tokens = 2


def test_a_rounds_self_times_add_up_to_its_wall_and_sampling_owns_its_gathers():
    clock = step_spans.StepClock()
    gather = step_spans.timed(clock, step_spans.GATHERS, lambda: time.sleep(0.001))

    def sample():
        gather()
        time.sleep(0.001)
    sampling = step_spans.timed(clock, step_spans.SAMPLING, sample)
    forward = step_spans.timed(clock, step_spans.GEMM, lambda: (gather(), time.sleep(0.002)))
    clock.recording = True
    clock.boundary()
    clock.note_plan(Plan())
    forward()
    sampling()
    clock.recording = False
    clock.boundary()
    [round_] = clock.rounds
    assert set(round_.parts) == {step_spans.GEMM, step_spans.GATHERS, step_spans.SAMPLING, step_spans.WAIT,
                                 step_spans.UNACCOUNTED}
    assert sum(round_.parts.values()) == pytest.approx(round_.wall_s, rel=1e-9)
    assert round_.parts[step_spans.SAMPLING] + round_.parts[step_spans.WAIT] >= 0.002  # its sleep and its gather's
    assert round_.parts[step_spans.GATHERS] < round_.parts[step_spans.SAMPLING]  # the forward's gather only
    assert (round_.num_decodes, round_.num_tokens) == (2, 2)


def _round(wall_ms: float, parts: dict, num_decodes: int = 8, num_tokens: int = 8) -> dict:
    return {"wall_ms": wall_ms, "num_decodes": num_decodes, "num_tokens": num_tokens, "on_cpu_ms": wall_ms,
            "wait_ms": 0.0, "parts_ms": parts}


def test_the_breakdown_takes_decode_only_rounds_at_the_batch_and_shows_what_no_part_covers():
    rounds = [_round(100.0, {step_spans.GEMM: 60.0, step_spans.ATTENTION: 20.0}),
              _round(300.0, {step_spans.GEMM: 290.0}, num_decodes=7, num_tokens=263),  # a prompt chunk with it
              _round(50.0, {step_spans.GEMM: 50.0}, num_decodes=4, num_tokens=4),
              _round(60.0, {step_spans.GEMM: 60.0}, num_decodes=4, num_tokens=4)]
    step = report.step_breakdown(rounds, batch=8)
    assert (step["batch"], step["rounds"], step["step_mean_ms"]) == (8, 1, 100.0)
    assert step["unaccounted_share"] == pytest.approx(0.2)  # over ADDS_UP_WITHIN: the harness missed a part
    fallback = report.step_breakdown(rounds, batch=2)  # none at 2: the most common decode batch
    assert (fallback["batch"], fallback["rounds"], fallback["step_mean_ms"]) == (4, 2, 55.0)


def test_the_harness_breaks_down_a_served_step_at_toy_size(model_factory, tmp_path):
    main = load_experiment("serve_profile").main
    assert main(["--model", model_factory("llama"), "--dtype", "float32", "--num-prompts", "4",
                 "--max-concurrency", "2", "--input-len", "16", "--output-len", "8", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "breakdown.json").read_text())
    run = result["runs"]["curve"]
    step = run["step"]
    assert step["rounds"] >= 1 and step["batch"] in (1, 2)
    for part in (step_spans.GEMM, step_spans.ATTENTION, step_spans.GATHERS, step_spans.SAMPLING,
                 step_spans.SCHEDULER, step_spans.ZMQ_IN, step_spans.ZMQ_OUT):
        assert step["parts_ms"][part] > 0, part
    assert step["unaccounted_share"] <= report.ADDS_UP_WITHIN
    assert step["parts_ms"][step_spans.WAIT] >= 0 and "ZMQbg/IO/0" in run["threads"]
    assert run["outside"]["router_cpu_ms_per_token"] > 0 and run["bench"]["completed"] == 4
    assert result["offline"]["step_median_ms"] > 0 and result["served_over_offline"] > 0
    table = (tmp_path / "breakdown.md").read_text()
    assert "| GEMMs (linears, lm_head) |" in table and "Served median step / offline median step" in table
