"""Per-phase results of `pdserve bench`: each request counts in the window it arrived in (by its sample, not
by when it ended), with the run's own metrics over those requests; the table has a row per window; and the
checks that phased and trace runs get before any work."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.serve import add_bench_args, check_args
from pdserve.bench.serve_metrics import RequestResult, compute_metrics
from pdserve.bench.serve_phase_report import format_phase_table, phase_results
from pdserve.bench.serve_phases import Phase, PhaseWindow


def done(start: float, ttft: float, latency: float, output_len: int = 5) -> RequestResult:
    return RequestResult(success=True, input_len=10, output_len=output_len, ttft=ttft,
                         itls=[(latency - ttft) / (output_len - 1)] * (output_len - 1), latency=latency, start=start)


WINDOWS = [PhaseWindow(1, 1, 0.0, 10.0, Phase(10, 5, 1.0, 10.0)),
           PhaseWindow(2, 1, 10.0, 20.0, Phase(10, 5, 2.0, 10.0)),
           PhaseWindow(1, 2, 20.0, 30.0, Phase(10, 5, 1.0, 10.0))]


def test_each_request_counts_in_the_window_it_arrived_in():
    # sample 1 arrived in window 0 but ended long after it: it stays in window 0
    results = [done(100.0, 0.1, 0.5), done(101.0, 0.2, 25.0), done(110.0, 3.0, 4.0),
               RequestResult(error="HTTP 500: boom", start=111.0), done(112.0, 0.1, 1.0)]
    owners = [0, 0, 1, 1, 1, 2]  # sample 5 (window 2) never ended: an interrupted run
    indices = [0, 1, 2, 3, 4]
    phases = phase_results(WINDOWS, owners, indices, results, {"ttft": 1000.0})
    assert [p["name"] for p in phases] == ["phase 1 cycle 1", "phase 2 cycle 1", "phase 1 cycle 2"]
    assert [p["num_requests"] for p in phases] == [2, 3, 1]
    assert [(p["completed"], p["failed"]) for p in phases] == [(2, 0), (2, 1), (0, 0)]
    first, second, third = phases
    assert first == {**first, **compute_metrics(results[:2], 26.0, {"ttft": 1000.0})}  # 100 -> 126: send to end
    assert first["median_ttft_ms"] == pytest.approx(150.0) and first["slo_attainment"] == 1.0
    assert second["duration"] == pytest.approx(4.0)  # 110 -> 114, the end of the slow one
    assert second["slo_attainment"] == pytest.approx(1 / 3)  # one TTFT of 3 s, one failure: one of three good
    assert second["request_goodput"] == pytest.approx(1 / 4.0)
    assert third["duration"] == 10.0 and third["request_throughput"] == 0.0  # nothing ended: its window's length
    assert (first["spec"], first["window_start_s"], first["window_end_s"]) == ("10:5:1:10", 0.0, 10.0)


def test_results_out_of_sample_order_are_attributed_by_their_index():
    results = [done(110.0, 0.3, 1.0), done(100.0, 0.1, 1.0)]
    phases = phase_results(WINDOWS[:2], [0, 1], [1, 0], results, {})
    assert phases[0]["mean_ttft_ms"] == pytest.approx(100.0) and phases[1]["mean_ttft_ms"] == pytest.approx(300.0)
    assert phases[0]["slo_attainment"] is None


def test_the_table_has_a_row_per_window():
    phases = phase_results(WINDOWS, [0, 1, 2], [0, 1, 2], [done(0, 0.1, 0.5)] * 3, {"ttft": 50.0})
    lines = format_phase_table(phases).splitlines()
    assert lines[1].split()[:4] == ["Phase", "Spec", "Sent", "Done/failed"]
    assert lines[2].split()[:6] == ["phase", "1", "cycle", "1", "10:5:1:10", "1"] and lines[2].endswith("0.0%")
    assert len(lines) == 5


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_bench_args(parser)
    args = parser.parse_args(argv)
    check_args(args)
    return args


@pytest.mark.parametrize(("argv", "message"), [
    (("--dataset", "phased", "--phases", "8:4:1:5", "--request-rate", "2"),
     r"--request-rate 2 with --dataset phased: the phases give the arrival times: leave --request-rate out"),
    (("--dataset", "trace", "--dataset-path", "t.jsonl", "--request-rate", "2"),
     r"the trace's arrival_s give the arrival times"),
    (("--dataset", "phased",), r"--dataset phased needs --phases"),
    (("--phases", "8:4:1:5",), r"--phases and --phase-cycles go with --dataset phased"),
    (("--dataset", "phased", "--phases", "8:4:1"), r"phase 1 '8:4:1' has 3 fields"),
    (("--dataset", "phased", "--phases", "8:4:1:5", "--phase-cycles", "0"), r"--phase-cycles 0 must be at least 1"),
    (("--dataset", "trace",), r"--dataset trace reads a file: pass --dataset-path FILE"),
])
def test_phased_and_trace_arguments_are_checked_before_any_work(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_num_prompts_keeps_its_default_except_for_scheduled_datasets():
    assert parse().num_prompts == 1000
    assert parse("--dataset", "phased", "--phases", "8:4:1:5").num_prompts is None
    assert parse("--dataset", "phased", "--phases", "8:4:1:5", "--num-prompts", "3").num_prompts == 3
    assert parse("--dataset-name", "trace", "--dataset-path", "t.jsonl").dataset == "trace"
