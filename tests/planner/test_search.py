"""The goodput search of `pdserve plan`: the grid search against step functions, a split's goodput against an
exhaustive scan of the grid, and the same rows for one worker or two."""

from __future__ import annotations

import pytest

from pdserve.planner.model.metrics import meets_target
from pdserve.planner.search.recommend import PlanSettings, run_split
from pdserve.planner.search.goodput import (
    RATE_STEPS,
    find_goodput,
    grid_index,
    grid_rate,
    grid_search,
    next_start,
    search_splits,
)
from pdserve.planner.model.simulator import ClusterSpec, StepModel
from pdserve.planner.model.workload import random_workload

COST = StepModel(prefill_intercept=0.02, prefill_per_token=2e-4, prefill_per_attention=1e-8, decode_intercept=0.03,
                 decode_per_seq=2e-3, decode_per_context=1e-6, transfer_latency=0.005, transfer_per_byte=1e-9)


def settings(num_prompts: int = 150) -> PlanSettings:
    workload = random_workload(num_prompts, 300, 30, range_ratio=0.5, seed=5)
    return PlanSettings(COST, workload, {"ttft": 400.0, "tpot": 60.0}, ClusterSpec(0, 1), seed=5)


def counting_step(threshold: int):
    """meets(i) = i <= threshold, and the indexes it was asked about."""
    asked: list[int] = []

    def meets(index: int) -> bool:
        asked.append(index)
        return index <= threshold

    return meets, asked


@pytest.mark.parametrize("threshold", [-40, -3, -1, 0, 1, 2, 5, 37, 300])
@pytest.mark.parametrize("start, first_step", [(0, 1), (0, RATE_STEPS), (10, 1), (-7, 4)])
def test_the_grid_search_finds_the_flip_from_any_start(threshold, start, first_step):
    meets, asked = counting_step(threshold)
    assert grid_search(meets, start, first_step, -1000, 1000) == (threshold, threshold + 1)
    assert len(asked) == len(set(asked))  # no index is probed twice


@pytest.mark.parametrize("threshold, most_probes", [(0, 2), (-1, 2), (1, 3), (2, 5), (-2, 3)])
def test_a_start_next_to_the_goodput_needs_few_probes(threshold, most_probes):
    meets, asked = counting_step(threshold)
    grid_search(meets, 0, 1, -1000, 1000)
    assert len(asked) <= most_probes


def test_the_grid_search_reports_no_rate_and_every_rate():
    assert grid_search(lambda index: False, 0, 1, -50, 50) == (None, -32)  # steps down 1, 1, 2, 4, ...: -64 is below the lowest
    low, high = grid_search(lambda index: True, 0, 1, -50, 50)
    assert high is None and low > 25


def test_the_next_start_scales_with_the_tier_that_bounds_the_goodput():
    assert next_start([(1, 9, 0, True), (2, 8, 32, True)], 4, 6) == 64  # rose with x: prefill-bound, ~ x
    assert next_start([(6, 4, 10, False), (7, 3, 0, False)], 8, 2) == -14  # fell: decode-bound, ~ y ** 0.75
    assert next_start([(32, 32, 93, False)], 33, 31) == 92  # one neighbour whose TPOT binds: ~ y
    assert next_start([(1, 63, 28, True)], 2, 62) == 60  # one neighbour whose TTFT binds: ~ x


def exhaustive_goodput(plan: PlanSettings, num_prefill: int, num_decode: int, lowest: int) -> int:
    """Every grid rate from `lowest` up, in full runs, until one misses the target: the index below it."""
    index = lowest
    assert meets_target(run_split(plan, num_prefill, num_decode, grid_rate(index)))
    while meets_target(run_split(plan, num_prefill, num_decode, grid_rate(index + 1))):
        index += 1
    return index


@pytest.mark.parametrize("num_prefill, num_decode", [(1, 1), (0, 2)])
def test_the_search_finds_the_exhaustive_scans_goodput(num_prefill, num_decode):
    plan = settings()
    expected = exhaustive_goodput(plan, num_prefill, num_decode, grid_index(1.0))
    for start, first_step in ((expected, 1), (expected - 9, 1), (expected + 5, 1), (grid_index(0.3), RATE_STEPS)):
        found = find_goodput(plan, num_prefill, num_decode, start, first_step)
        assert found.index == expected, f"from {start}"
        assert found.rate == pytest.approx(grid_rate(expected))
        assert meets_target(found.metrics)
    assert find_goodput(plan, num_prefill, num_decode, expected).probes == 2  # its own goodput: pass, then a miss


def test_one_worker_or_two_give_the_same_rows():
    plan = settings(100)
    alone = search_splits(plan, 4, jobs=1)
    pooled = search_splits(plan, 4, jobs=2)
    assert alone == pooled
    assert [row["config"] for row in alone] == ["0P4D", "1P3D", "2P2D", "3P1D"]
    for row in alone:
        assert row["goodput"] > 0 and row["probes"] >= 2
        assert meets_target(run_split(plan, row["num_prefill"], row["num_decode"], row["goodput"]))
        assert not meets_target(run_split(plan, row["num_prefill"], row["num_decode"],
                                          row["goodput"] * 2 ** (1 / RATE_STEPS)))
