"""`pdserve plan` end to end through the command line: splits, goodput search, bad input, --validate."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from pdserve.planner.cli import recommendation
from pdserve.planner.validate.error_pieces import PIECES
from pdserve.planner.search.recommend import recommend
from pdserve.planner.profile.fit import model_identity
from pdserve.planner.validate.sampling import expected_sampling_error
from pdserve.planner.model.simulator import ClusterSpec, StepModel, simulate
from pdserve.cli import main
from tests.planner.helpers import synthetic_profile, write_sweep


def plan(profile_path, out, *extra) -> int:
    return main(["plan", "--profile", profile_path, "--num-prompts", "200", "--input-len", "256", "--output-len", "32",
                 "--output-dir", str(out), *extra])


def test_plan_at_a_rate_simulates_every_split(profile_path, tmp_path, capsys):
    out = tmp_path / "plan"
    assert plan(profile_path, out, "--engines", "3", "--slo", "ttft:1000", "tpot:100", "--request-rate", "8") == 0
    result = json.loads((out / "plan.json").read_text())
    assert [row["config"] for row in result["splits"]] == ["0P3D", "1P2D", "2P1D"]
    assert result["recommended"]["config"] in {"0P3D", "1P2D", "2P1D"}
    assert all(0.0 <= row["slo_attainment"] <= 1.0 for row in result["splits"])
    assert (out / "plan_goodput.png").stat().st_size > 0
    assert "recommended:" in capsys.readouterr().out


def test_plan_prints_the_up_line_and_search_progress_and_writes_outside_the_repository(profile_path, tmp_path,
                                                                                          monkeypatch, capsys):
    """Without --output-dir the plan goes to a new folder under the system's temp directory; the recommended split
    comes with its `pdserve up` line; the search reports each split on stderr (not a terminal here)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["plan", "--profile", profile_path, "--num-prompts", "200", "--input-len", "256", "--output-len",
                 "32", "--engines", "3", "--slo", "ttft:1000", "tpot:100", "--decode-policy", "round_robin"]) == 0
    captured = capsys.readouterr()
    [written] = list((tmp_path / "pdserve-plans").glob("*/plan.json"))
    best = json.loads(written.read_text())["recommended"]
    assert (written.parent / "plan_goodput.png").stat().st_size > 0
    assert (f"pdserve up --num-prefill {best['num_prefill']} --num-decode {best['num_decode']} --dtype float32 "
            "--decode-policy round_robin") in captured.out
    searched = [line for line in captured.err.splitlines() if line.startswith("pdserve plan: goodput search [")]
    assert len(searched) == 3 and all(" searched: goodput " in line for line in searched)
    assert searched[-1].startswith("pdserve plan: goodput search [3/3]")


def test_find_goodput_and_the_smallest_cluster_for_a_target(profile_path, tmp_path):
    out = tmp_path / "plan"
    assert plan(profile_path, out, "--engines", "4", "--slo", "ttft:800", "tpot:80", "--find-goodput",
                "--target-rate", "5", "--no-plots") == 0
    result = json.loads((out / "plan.json").read_text())
    goodputs = [row["goodput"] for row in result["splits"]]
    assert max(goodputs) > 0
    best = result["recommended"]
    assert best["goodput"] == max(goodputs)
    assert result["smallest"] is None or result["smallest"]["num_engines"] <= 4


@pytest.mark.parametrize("extra, message", [
    (["--engines", "2", "--slo", "ttft:1", "--request-rate", "1"], "below the unloaded TTFT"),
    (["--engines", "2", "--slo", "ttft:1000", "--request-rate", "1", "--num-prompts", "0"], "no requests"),
    (["--engines", "2", "--request-rate", "1"], "pass --slo"),
    (["--engines", "2", "--slo", "ttft:1000", "--jobs", "0"], "--jobs 0"),
    (["--engines", "2", "--slo", "ttft:soon"], "--slo 'ttft:soon'"),
    (["--engines", "100000", "--slo", "ttft:1000"], "--engines 100000: plan splits at most 1024 engines"),
    (["--engines", "2", "--slo", "ttft:1000", "--exact-up-to", "-1"], "--exact-up-to -1: give 0 or more"),
    (["--engines", "2", "--slo", "ttft:1000", "--host-cpu-per-token", "-5"], "--host-cpu-per-token -5: give the"),
    (["--engines", "2", "--slo", "ttft:1000", "--local-prefill-threshold", "-5"], "--local-prefill-threshold -5: give"),
])
def test_bad_input_gets_a_clear_error(profile_path, tmp_path, capsys, extra, message):
    assert plan(profile_path, tmp_path / "plan", *extra) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("under", ["", "x"])
def test_an_output_dir_that_is_a_file_is_refused_before_simulating(profile_path, tmp_path, capsys, under):
    taken = tmp_path / "taken"
    taken.write_text("")
    out = taken / under if under else taken
    assert plan(profile_path, out, "--engines", "2", "--slo", "ttft:1000", "--request-rate", "1") == 2
    captured = capsys.readouterr()
    assert f"--output-dir {out}" in captured.err and "recommended" not in captured.out
    assert taken.read_text() == ""


def test_no_split_with_goodput_recommends_none():
    """A plan whose every split has no goodput (no request met the SLOs) recommends nothing, as `plan --validate`
    judges a prediction (an outside probe: --request-rate inf recommended 0P2D at 0 req/s)."""
    rows = [{"config": config, "num_prefill": x, "goodput_per_engine": 0.0} for config, x in (("0P2D", 0), ("1P1D", 1))]
    assert recommend(rows) is None
    args = argparse.Namespace(slo=["ttft:100"], request_rate=math.inf)
    assert recommendation(None, args).startswith("recommended: none (no split meets ttft:100 at inf req/s")
    rows[1]["goodput_per_engine"] = 0.5
    assert recommend(rows)["config"] == "1P1D"


def test_a_profile_of_another_model_is_refused(profile_path, tmp_path, capsys, model_factory):
    other = model_factory("qwen2")
    assert plan(profile_path, tmp_path / "plan", "--engines", "2", "--slo", "ttft:1000", "--model", other) == 2
    assert "another model" in capsys.readouterr().err


def test_validate_replays_a_sweep_and_finds_its_own_predictions(profile_path, tmp_path, tiny_model):
    from pdserve.planner.profile.fit import load_profile

    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path))
    out = tmp_path / "validation"
    assert main(["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--output-dir", str(out),
                 "--diagnose"]) == 0
    result = json.loads((out / "validation.json").read_text())
    summary = result["summary"]
    assert summary["num_points"] == 4
    assert summary["attainment_mae_pp"] == pytest.approx(0.0, abs=1e-9)
    assert summary["median_ttft_ms_mean_relative_error"] == pytest.approx(0.0, abs=1e-9)
    assert summary["median_first_itl_ms_mean_relative_error"] == pytest.approx(0.0, abs=1e-9)
    assert summary["attainment_mae_pp_with_measured"] == pytest.approx(dict.fromkeys(PIECES, 0.0), abs=1e-9)
    floors = [expected_sampling_error(p["num_requests"], p["predicted_slo_attainment"]) for p in result["points"]]
    assert summary["attainment_sampling_floor_pp"] == pytest.approx(100 * sum(floors) / len(floors))
    assert all(group["agrees"] for group in summary["goodput"])
    assert (out / "validation.png").stat().st_size > 0


def test_validate_reports_the_error_of_a_sweep_that_ran_slower(profile_path, tmp_path, tiny_model):
    from pdserve.planner.profile.fit import load_profile

    sweep_dir = tmp_path / "sweep"
    profile = load_profile(profile_path)
    write_sweep(sweep_dir, tiny_model, profile, shift=0.5)
    write_unloaded(sweep_dir, profile, slower=1.5)
    out = tmp_path / "validation"
    assert main(["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--output-dir", str(out),
                 "--no-plots", "--diagnose"]) == 0
    summary = json.loads((out / "validation.json").read_text())["summary"]
    assert summary["median_ttft_ms_mean_relative_error"] == pytest.approx(1 / 3, rel=1e-6)  # predicted / measured = 1 / 1.5
    assert summary["median_first_itl_ms_mean_relative_error"] == pytest.approx(1 / 3, rel=1e-6)
    [drift] = summary["unloaded"]  # the machine's drift, from the unloaded pass: 50% slower than the profile
    assert drift["measured_ttft_ms"] / drift["profile_prefill_ms"] == pytest.approx(1.5)
    # 1P1D's TPOT holds the first ITL (the KV transfer): set against the simulator's TPOT alone, not a plain step
    # (rel: the simulated steps grow with the context, the pass's later ITLs are the step at its middle)
    assert drift["measured_tpot_ms"] / drift["simulated_tpot_ms"] == pytest.approx(1.5, rel=1e-3)
    assert drift["measured_first_itl_ms"] / drift["simulated_first_itl_ms"] == pytest.approx(1.5)
    assert drift["measured_later_itl_ms"] / drift["profile_decode_step_ms"] == pytest.approx(1.5)
    assert drift["simulated_first_itl_ms"] > drift["profile_decode_step_ms"]  # the transfer is in it


def test_validate_finds_the_piece_that_carries_the_attainment_error(profile_path, tmp_path, tiny_model):
    from pdserve.planner.profile.fit import load_profile

    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path), later_shift=0.5)  # decode steps 50% slower
    out = tmp_path / "validation"
    assert main(["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--output-dir", str(out),
                 "--no-plots", "--diagnose"]) == 0
    summary = json.loads((out / "validation.json").read_text())["summary"]
    assert summary["attainment_mae_pp"] > 5  # the slower steps cross the TPOT SLO
    assert summary["median_ttft_ms_mean_relative_error"] == pytest.approx(0.0, abs=1e-9)
    pieces = summary["attainment_mae_pp_with_measured"]
    assert pieces["later_itls"] == pytest.approx(0.0, abs=1e-9)  # the measured decode steps explain it all
    assert pieces["ttft"] == pytest.approx(summary["attainment_mae_pp"])
    assert pieces["first_itl"] == pytest.approx(summary["attainment_mae_pp"])


def test_plain_validate_leaves_the_diagnostics_to_diagnose(profile_path, tmp_path, tiny_model, capsys):
    from pdserve.planner.profile.fit import load_profile

    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path), references=2)
    base = ["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--no-plots"]
    assert main([*base, "--output-dir", str(tmp_path / "plain")]) == 0
    plain = capsys.readouterr().out
    assert "TTFT p50 meas" in plain and "SLO attainment MAE" in plain and "TTFT p90 meas" not in plain
    assert "met: the share of requests that met every SLO" in plain  # a legend line per column
    for diagnostic in ("step meas/prof", "busy P meas/sim", "ref P", "one piece of every request", "unloaded"):
        assert diagnostic not in plain
    points = json.loads((tmp_path / "plain" / "validation.json").read_text())["points"]
    assert not any("measured_step_ratio" in point or "reference_speed_prefill" in point for point in points)
    assert main([*base, "--output-dir", str(tmp_path / "diagnosed"), "--diagnose"]) == 0
    diagnosed = capsys.readouterr().out
    assert all(column in diagnosed for column in ("step meas/prof", "busy P meas/sim", "ref P", "ref D"))
    assert json.loads((tmp_path / "diagnosed" / "validation.json").read_text())["points"][0]["measured_step_ratio"]


def test_validate_judges_the_runs_by_the_slos_given(profile_path, tmp_path, tiny_model):
    from pdserve.planner.profile.fit import load_profile

    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path), later_shift=0.5)  # misses its own tpot:40
    out = tmp_path / "validation"
    assert main(["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--output-dir", str(out),
                 "--no-plots", "--slo", "ttft:100000", "tpot:100000"]) == 0
    result = json.loads((out / "validation.json").read_text())
    assert result["slos_ms_override"] == {"ttft": 100000.0, "tpot": 100000.0}
    for point in result["points"]:  # every request meets SLOs this loose, measured and predicted alike
        assert point["slos_ms"] == result["slos_ms_override"]
        assert point["measured_slo_attainment"] == point["predicted_slo_attainment"] == 1.0
    assert result["summary"]["attainment_mae_pp"] == 0.0


def write_unloaded(sweep_dir, profile, slower: float) -> None:
    """An unloaded pass (one request at a time) whose TTFT is the profile's prefill step, whose first ITL is the
    simulator's for that request alone on 1P1D (transfer, then a step) and whose later ITLs are the profile's
    batch-1 decode step, all times `slower`."""
    model = StepModel.from_profile(profile)
    prompt, output = 100, 11
    prefill = model.step_seconds(0, 0, prompt, prompt * prompt) * slower
    step = model.step_seconds(1, prompt + output // 2, 0, 0.0) * slower
    alone, = simulate(ClusterSpec(1, 1, profile.engine, profile.model.kv_bytes_per_token), model, [0.0], [prompt],
                      [output])
    first_itl = alone.first_itl * slower
    itls = [first_itl] + [step] * (output - 2)
    run = {"config": "1P1D", "phase": "unloaded", "request_rate": "inf", "max_concurrency": 1,
           "sweep": {"config": "1P1D", "phase": "unloaded", "num_prefill": 1, "num_decode": 1, "num_engines": 2},
           "input_lens": [prompt] * 3, "output_lens": [output] * 3, "ttfts": [prefill] * 3,
           "e2els": [prefill + sum(itls)] * 3, "itls": [itls] * 3, "errors": [""] * 3}
    (sweep_dir / "runs" / "1P1D_rateinf_conc1_unloaded.json").write_text(json.dumps(run))


def test_validate_refuses_a_sweep_of_another_model(tmp_path, model_factory, capsys):
    other = model_factory("qwen2")
    profile = synthetic_profile(model_identity(model_factory()))
    path = tmp_path / "profile.json"
    path.write_text(profile.model_dump_json())
    write_sweep(tmp_path / "sweep", other, profile)
    assert main(["plan", "--profile", str(path), "--validate", str(tmp_path / "sweep")]) == 2
    assert "another model" in capsys.readouterr().err


@pytest.mark.parametrize("extra, named", [(["--request-rate", "3"], "--request-rate"),
                                          (["--find-goodput", "--target-rate", "2"], "--target-rate, --find-goodput")])
def test_validate_refuses_what_it_would_ignore(profile_path, tmp_path, capsys, extra, named):
    """The replay takes layouts and rates from the sweep: these flags were silently dropped."""
    assert main(["plan", "--profile", profile_path, "--validate", str(tmp_path), *extra]) == 2
    assert f"{named} with --validate: the replay runs the sweep's own" in capsys.readouterr().err


def test_validate_needs_a_sweep_directory(profile_path, tmp_path, capsys):
    assert main(["plan", "--profile", profile_path, "--validate", str(tmp_path)]) == 2
    assert "runs/*.json" in capsys.readouterr().err


def test_plan_without_matplotlib_leaves_the_plot_out_with_a_sentence(profile_path, tmp_path, monkeypatch, capsys):
    """simpy is in the base install, matplotlib in the [bench] extra: the plan still runs, the PNG is left out."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "plan"
    assert plan(profile_path, out, "--engines", "2", "--slo", "ttft:1000", "tpot:100", "--request-rate", "4") == 0
    printed = capsys.readouterr().out
    assert "plan_goodput.png left out: the plots need matplotlib" in printed
    assert (out / "plan.json").exists() and not (out / "plan_goodput.png").exists()


def test_the_goodput_plot_draws_an_unbounded_split_and_names_the_slos_and_workload(tmp_path):
    """A split whose search found no rate it fails at has an infinite goodput: drawn (hatched), not a matplotlib
    error about infinite axis limits; the title carries the SLOs and the workload."""
    from pdserve.planner.cli import plot_title
    from pdserve.planner.plots import bar_heights, plot_goodput

    rows = [{"config": "0P2D", "num_engines": 2, "goodput_per_engine": math.inf},
            {"config": "1P1D", "num_engines": 2, "goodput_per_engine": 3.0}]
    assert bar_heights([math.inf, 3.0]) == [pytest.approx(3.3), 3.0]
    args = argparse.Namespace(engines=2, slo=["ttft:1000", "tpot:100"], num_prompts=200, dataset="random",
                              input_len=256, output_len=32, request_rate=None)
    title = plot_title(args)
    assert "ttft:1000 tpot:100" in title and "256 in / 32 out tokens" in title and "200 requests" in title
    plot_goodput(rows, tmp_path / "plan_goodput.png", rows[0], title)
    assert (tmp_path / "plan_goodput.png").stat().st_size > 0
