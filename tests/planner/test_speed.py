"""The machine's speed around each point of a sweep (planner/validate/speed.py) and `plan --validate --per-point-speed`."""

from __future__ import annotations

import json

import pytest

from pdserve.planner.profile.fit import load_profile
from pdserve.planner.model.simulator import ClusterSpec
from pdserve.planner.validate.speed import ReferenceSpeed, Speed, reference_speed, speed_around
from pdserve.cli import main
from tests.planner.helpers import profile_machine, reference_run, write_sweep


@pytest.mark.parametrize("layout", [(1, 1), (0, 2)])
def test_a_reference_run_gives_the_machines_speed_against_the_profile(profile_path, layout):
    profile = load_profile(profile_path)
    spec = ClusterSpec(*layout, profile.engine, profile.model.kv_bytes_per_token)
    machine, effects = profile_machine(profile, (1.3, 0.8))
    run = reference_run(spec, machine, 3, 200, 20, effects)  # prompts slower, steps faster
    run["sweep"] = {"num_prefill": layout[0], "num_decode": layout[1]}
    model, effects = profile_machine(profile)
    speed = reference_speed(run, model, spec, effects)
    assert speed.prefill == pytest.approx(1.3, rel=1e-6)
    assert speed.decode == pytest.approx(0.8, rel=1e-6)


def test_a_reference_run_without_later_itls_has_no_decode_speed_and_failed_requests_do_not_count(profile_path):
    profile = load_profile(profile_path)
    spec = ClusterSpec(0, 1, profile.engine, profile.model.kv_bytes_per_token)
    machine, effects = profile_machine(profile, (2.0, 2.0))
    run = reference_run(spec, machine, 2, 100, 2, effects)
    run["sweep"] = {"num_prefill": 0, "num_decode": 1}
    run["errors"] = ["", "the server closed the stream"]
    run["ttfts"][1] = 0.0
    model, effects = profile_machine(profile)
    speed = reference_speed(run, model, spec, effects)
    assert speed.prefill == pytest.approx(2.0, rel=1e-6) and speed.decode is None
    run["errors"] = ["timed out", "the server closed the stream"]
    assert reference_speed(run, model, spec, effects) is None


def test_a_point_takes_the_geometric_mean_of_the_references_either_side_of_it():
    references = [ReferenceSpeed("1P1D", 0, Speed(1.0, 1.0)), ReferenceSpeed("1P1D", 2, Speed(1.44, 0.81)),
                  ReferenceSpeed("1P1D", 4, Speed(4.0, None)), ReferenceSpeed("0P2D", 1, Speed(9.0, 9.0))]
    at = {order: speed_around({"config": "1P1D", "sweep": {"order": order}}, references) for order in (1, 3, 5)}
    assert (at[1].prefill, at[1].decode) == pytest.approx((1.2, 0.9))  # between orders 0 and 2
    assert (at[3].prefill, at[3].decode) == pytest.approx((2.4, 0.81))  # order 4 measured no decode
    assert (at[5].prefill, at[5].decode) == pytest.approx((4.0, None))  # after the last: one side only
    assert speed_around({"config": "1P1D", "sweep": {}}, references) is None  # a sweep without references
    assert speed_around({"config": "2P2D", "sweep": {"order": 1}}, references) is None  # another server's


def validate(profile_path, sweep_dir, out, *extra) -> dict:
    assert main(["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--output-dir", str(out),
                 "--no-plots", *extra]) == 0
    return json.loads((out / "validation.json").read_text())


def test_per_point_speed_takes_the_machines_drift_out_of_the_validation(profile_path, tmp_path, tiny_model, capsys):
    """A sweep on a machine 40% slower at prompts and 25% slower at decode steps than when it was profiled: as
    profiled, the prediction is off; scaled by the reference runs around each point, it is exact again."""
    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path), speed=(1.4, 1.25), references=2)
    before = validate(profile_path, sweep_dir, tmp_path / "as-profiled", "--diagnose")
    as_profiled = before["summary"]
    assert as_profiled["median_ttft_ms_mean_relative_error"] > 0.2
    assert as_profiled["median_tpot_ms_mean_relative_error"] > 0.15
    assert as_profiled["reference_speed_prefill_range"] == pytest.approx([1.4, 1.4])
    assert as_profiled["reference_speed_decode_range"] == pytest.approx([1.25, 1.25])
    assert "ref P" in capsys.readouterr().out  # the speeds are in the table
    busy = {(p["config"], p["request_rate"]): p["prefill_busy_ratio"] for p in before["points"]}
    assert {key: ratio for key, ratio in busy.items() if key[0] == "0P2D"} == {("0P2D", 2.0): None, ("0P2D", 6.0): None}
    for key in (("1P1D", 2.0), ("1P1D", 6.0)):  # the prefill engine's 40%, whatever its queue did
        assert busy[key] == pytest.approx(1.4, rel=0.01), busy
    measured = [ratio for ratio in busy.values() if ratio is not None]
    assert as_profiled["prefill_busy_ratio_range"] == [min(measured), max(measured)]

    result = validate(profile_path, sweep_dir, tmp_path / "per-point", "--per-point-speed", "--diagnose")
    summary = result["summary"]
    assert summary["per_point_speed"] is True
    assert summary["attainment_mae_pp"] == pytest.approx(0.0, abs=1e-9)
    for key in ("median_ttft_ms", "median_tpot_ms", "p90_tpot_ms"):
        assert summary[f"{key}_mean_relative_error"] == pytest.approx(0.0, abs=1e-6)
    # the step check now sets the measured steps against the scaled ones
    assert [p["measured_step_ratio"] for p in result["points"]] == pytest.approx(
        [p["measured_step_ratio"] / 1.25 for p in before["points"]])
    assert [p["prefill_busy_ratio"] for p in result["points"] if p["config"] == "1P1D"] == pytest.approx([1.0, 1.0])
    assert "scaled by them (--per-point-speed)" in capsys.readouterr().out


def test_per_point_speed_needs_reference_runs_and_validate_and_no_step_scale(profile_path, tmp_path, tiny_model,
                                                                              capsys):
    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path))  # a sweep run without --reference-requests
    base = ["plan", "--profile", profile_path, "--output-dir", str(tmp_path / "out"), "--no-plots"]
    assert main([*base, "--validate", str(sweep_dir), "--per-point-speed"]) == 2
    assert "--reference-requests" in capsys.readouterr().err
    assert main([*base, "--validate", str(sweep_dir), "--per-point-speed", "--step-scale", "1.1", "1"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main([*base, "--engines", "2", "--slo", "ttft:1000", "--per-point-speed"]) == 2
    assert "goes with --validate" in capsys.readouterr().err
