"""pdserve.progress: in a log, the time left is each remaining step's floor plus the mean time the finished steps
took beyond theirs."""

from __future__ import annotations

import io

import pytest

from pdserve import progress as progress_module
from pdserve.progress import Progress, format_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    return clock


def run_step(progress: Progress, clock: Clock, seconds: float) -> str:
    progress.start("a step")
    line = progress.file.getvalue().splitlines()[-1]
    clock.now += seconds
    progress.finish()
    return line


def test_a_load_runs_arrival_span_counts_before_it_runs(clock):
    # a warm-up, a reference run, a load of 240 s of arrivals, a reference run
    progress = Progress(4, "[sweep]", file=io.StringIO(), tty=False, floors=[0, 0, 240, 0])
    assert run_step(progress, clock, 10).endswith("(time left not known yet)")
    # 10 s a step beyond its floor: 3 steps left, one of them spanning 240 s of arrivals
    assert run_step(progress, clock, 10).endswith(f"(about {format_seconds(3 * 10 + 240)} left)")
    assert run_step(progress, clock, 250).endswith(f"(about {format_seconds(2 * 10 + 240)} left)")
    assert run_step(progress, clock, 10).endswith("(about 10s left)")


def test_added_steps_come_next_and_removed_ones_are_the_next(clock):
    progress = Progress(3, "[sweep]", file=io.StringIO(), tty=False, floors=[0, 100, 0])
    run_step(progress, clock, 20)
    progress.add(2)  # two probes of unknown length run next
    assert progress.floors == [0, 0, 100, 0]
    assert run_step(progress, clock, 20).endswith(f"(about {format_seconds(4 * 20 + 100)} left)")
    progress.add(-2)  # the next two will not run
    assert progress.total == 3 and progress.floors == [0]


def test_without_floors_the_estimate_is_the_mean_step_including_the_set_up_between(clock):
    progress = Progress(3, "[profile]", file=io.StringIO(), tty=False, first_estimate_s=5)
    assert run_step(progress, clock, 4).endswith("(about 15s left)")
    clock.now += 6  # set-up before the second step counts as its time
    assert run_step(progress, clock, 4).endswith("(about 8s left)")  # 2 steps of 4 s
    assert run_step(progress, clock, 4).endswith("(about 7s left)")  # steps of 4 and 6 + 4 s
