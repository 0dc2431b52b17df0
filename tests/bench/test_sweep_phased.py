"""`pdserve sweep` with bench's phased and trace datasets: --phases and --phase-cycles pass through, every run
sends the whole schedule (no --num-prompts unless given), and a finite rate or a goodput search is refused
before any layout starts."""

from __future__ import annotations

import math
import re

import pytest

from pdserve.bench.sweep_results import RunInfo
from tests.bench.test_sweep_parts import sweep_args


def test_phases_pass_through_and_each_run_sends_the_whole_schedule(tmp_path):
    from pdserve.bench.sweep import build_plan
    from pdserve.bench.sweep_runs import bench_command

    plan = build_plan(sweep_args("--request-rates", "inf", "--max-concurrencies", "8", "--dataset", "phased",
                                 "--phases", "1000:48:0.3:60,128:256:1:60", "--phase-cycles", "2"))
    command = bench_command(plan.bench, "http://h:1", RunInfo("1P1D", 2, "sweep", math.inf, 8, 1, 1),
                            tmp_path / "r.json")
    text = " ".join(command)
    assert "--num-prompts" not in command and "--request-rate inf" in text
    assert "--dataset phased --phases 1000:48:0.3:60,128:256:1:60 --phase-cycles 2" in text
    given = build_plan(sweep_args("--max-concurrencies", "8", "--dataset", "phased", "--phases", "8:4:1:5",
                                  "--num-prompts", "20"))
    assert given.bench.num_prompts == 20  # the first 20 of the schedule
    assert build_plan(sweep_args("--request-rates", "1")).bench.num_prompts == 50


@pytest.mark.parametrize("argv, says", [
    (("--request-rates", "2"), "--dataset phased brings its own arrival times: load it with --request-rates inf"),
    (("--max-concurrencies", "4", "--find-goodput", "--goodput", "ttft:500"), "without a rate or --find-goodput"),
    (("--request-rates", "inf", "--phases", "8:4"), "phase 1 '8:4' has 2 fields"),
])
def test_a_rate_a_search_or_a_bad_phase_is_refused_before_any_layout_starts(argv, says):
    from pdserve.bench.sweep import build_plan

    argv = ("--dataset", "phased", *(() if "--phases" in argv else ("--phases", "8:4:1:5")), *argv)
    with pytest.raises(ValueError, match=re.escape(says)):
        build_plan(sweep_args(*argv))
