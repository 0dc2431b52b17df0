"""A run's decode steps against the profile's step for the batch they ran in, reconstructed from its arrays."""

from __future__ import annotations

import math
import pytest

from pdserve.planner.model.host_effects import HostEffects
from pdserve.planner.validate.step_check import step_ratio
from tests.planner.test_simulator import model

STEP = model(decode_intercept=0.02, decode_per_seq=0.001, decode_per_context=1e-5)
PADS = HostEffects(decode_pads_to_longest=True)


def lockstep_run(prompts: list[int], outputs: list[int], slower: float = 1.0) -> dict:
    """Requests sent together whose first tokens come at once, then one decode step for all per token: step j
    reads batch x the longest context of the moment (prompt + the j + 1 tokens each had)."""
    itls = [[] for _ in prompts]
    for j in range(max(outputs) - 1):
        active = [i for i, n in enumerate(outputs) if j < n - 1]
        longest = max(prompts[i] + j + 1 for i in active)
        seconds = slower * STEP.step_seconds(len(active), len(active) * longest, 0, 0.0)
        for i in active:
            itls[i].append(seconds)
    return {"request_rate": math.inf, "seed": 0, "ttfts": [0.0] * len(prompts), "itls": itls,
            "input_lens": prompts, "errors": [""] * len(prompts)}


def test_steps_on_the_profile_read_as_one_and_a_slower_machine_as_its_factor():
    assert step_ratio(lockstep_run([300, 100], [10, 30]), STEP, 1, PADS) == pytest.approx(1.0)
    assert step_ratio(lockstep_run([300, 100], [10, 30], slower=1.5), STEP, 1, PADS) == pytest.approx(1.5)


def test_the_context_term_follows_the_backend():
    run = lockstep_run([300, 100], [20, 24])  # together for most steps: the padding is most of the context
    assert step_ratio(run, STEP, 1) > 1.05  # the sum under-predicts
    # a grouping backend puts 300 and 100 tokens in one group (200 tokens of padding): it reads what padding does
    assert step_ratio(run, STEP, 1, HostEffects(decode_groups_by_length=True)) == pytest.approx(1.0)


def test_a_run_without_later_itls_has_no_ratio():
    assert step_ratio(lockstep_run([50, 60], [2, 2]), STEP, 1, PADS) is None
