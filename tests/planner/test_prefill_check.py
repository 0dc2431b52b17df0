"""A run's prefill engine busy time against the simulator's, reconstructed from arrivals and first tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.planner.validate.prefill_check import busy_seconds, prefill_busy_ratio
from pdserve.planner.profile.fit import EngineSettings
from pdserve.planner.model.simulator import ClusterSpec, simulate
from pdserve.planner.model.workload import random_workload
from tests.planner.test_simulator import model

RATE, SEED = 10.0, 3  # the prompts alone keep the engine 70% busy (x1.25: 88%)
STEP = model(prefill_per_token=2e-4, decode_intercept=0.02, decode_per_seq=0.001)


def test_busy_time_of_one_fifo_server():
    assert busy_seconds([0.0, 1.0, 2.0], [3.0, 6.0, 9.0]) == pytest.approx(9.0)  # a queue: back to back
    assert busy_seconds([0.0, 10.0], [2.0, 12.0]) == pytest.approx(4.0)  # idle between them
    assert busy_seconds([10.0, 0.0], [12.0, 2.0]) == pytest.approx(4.0)  # walked in the order they left
    assert busy_seconds([0.0, 0.5, 0.5], [4.0, 4.0, 6.0]) == pytest.approx(6.0)  # two finished in one step


def simulated_run(spec: ClusterSpec, step, prefill_scale: float = 1.0) -> tuple[dict, list]:
    """A run in bench's format whose TTFTs come from the simulator with the prefill steps `prefill_scale` slower."""
    workload = random_workload(60, 300, 8, range_ratio=0.5, seed=SEED)
    slow = replace(step, prefill_intercept=step.prefill_intercept * prefill_scale,
                   prefill_per_token=step.prefill_per_token * prefill_scale)
    arrivals = workload.arrivals(RATE, seed=SEED)
    measured = simulate(spec, slow, arrivals, workload.prompt_lens, workload.output_lens)
    run = {"request_rate": RATE, "seed": SEED, "burstiness": 1.0, "ttfts": [r.ttft for r in measured],
           "errors": [""] * len(measured)}
    return run, simulate(spec, step, arrivals, workload.prompt_lens, workload.output_lens)


@pytest.mark.parametrize("scale", [1.0, 1.25])
def test_a_slower_prefill_engine_reads_as_its_factor(scale):
    spec = ClusterSpec(1, 1, EngineSettings(max_num_batched_tokens=512))  # prompts queue and share steps
    run, predicted = simulated_run(spec, STEP, scale)
    assert max(r.ttft for r in predicted) > 3 * min(r.ttft for r in predicted), "the load queues prompts"
    assert prefill_busy_ratio(run, predicted, num_prefill=1) == pytest.approx(scale, rel=1e-6)
    if scale > 1:  # the TTFTs themselves read the queue's growth, far more than the engine's speed
        assert sum(run["ttfts"]) / sum(r.ttft for r in predicted) > scale + 0.3


def test_a_run_with_a_failed_request_gives_none():
    run, predicted = simulated_run(ClusterSpec(1, 1), STEP, 1.25)
    assert prefill_busy_ratio(run, predicted, num_prefill=1) == pytest.approx(1.25, rel=1e-6)
    run["errors"][-1] = "timeout"  # its prompt's work: in the next first token's wait, or nowhere
    assert prefill_busy_ratio(run, predicted, num_prefill=1) is None


def test_no_ratio_without_exactly_one_prefill_engine_or_with_local_prefill():
    run, predicted = simulated_run(ClusterSpec(0, 2), STEP)
    assert prefill_busy_ratio(run, predicted, num_prefill=0) is None
    run, predicted = simulated_run(ClusterSpec(2, 1), STEP)
    assert prefill_busy_ratio(run, predicted, num_prefill=2) is None
    run, predicted = simulated_run(ClusterSpec(1, 1, local_prefill_threshold=200), STEP)
    assert not all(r.remote for r in predicted)
    assert prefill_busy_ratio(run, predicted, num_prefill=1) is None
