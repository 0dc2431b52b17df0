"""Two measurements of the same sweep compared point by point, at the first one's SLOs."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.sweep_results import slo_attainment
from pdserve.planner.profile.fit import model_identity
from tests.experiments import load_experiment
from tests.planner.helpers import synthetic_profile, write_sweep

main = load_experiment("sweep_repeat").main


@pytest.fixture
def sweeps(tmp_path, model_factory):
    model = model_factory()
    profile = synthetic_profile(model_identity(model))
    write_sweep(tmp_path / "first", model, profile)
    write_sweep(tmp_path / "same", model, profile)
    write_sweep(tmp_path / "slower", model, profile, shift=0.5)
    return tmp_path


def test_the_same_measurement_twice_differs_by_nothing(sweeps, capsys):
    assert main([str(sweeps / "first"), str(sweeps / "same"), "--json", str(sweeps / "same.json")]) == 0
    summary = json.loads((sweeps / "same.json").read_text())["summary"]
    assert summary["num_points"] == 4
    assert summary["attainment_mean_abs_difference_pp"] == 0.0
    assert summary["median_tpot_ms_mean_abs_change"] == 0.0
    assert "4 points" in capsys.readouterr().out


def test_a_slower_measurement_shows_its_change_at_the_first_sweeps_slos(sweeps):
    assert main([str(sweeps / "first"), str(sweeps / "slower"), "--json", str(sweeps / "slower.json")]) == 0
    result = json.loads((sweeps / "slower.json").read_text())
    assert result["summary"]["median_ttft_ms_mean_abs_change"] == pytest.approx(0.5)
    assert result["summary"]["median_ttft_ms_change_range"] == pytest.approx([0.5, 0.5])
    expected = []
    for name in ("1P1D_rate2.0", "1P1D_rate6.0", "0P2D_rate2.0", "0P2D_rate6.0"):
        first, slower = (json.loads((sweeps / side / "runs" / f"{name}.json").read_text())
                         for side in ("first", "slower"))
        expected.append(abs(slo_attainment(slower, first["goodput"]) - slo_attainment(first, first["goodput"])))
    assert max(expected) > 0  # the shift moves some requests past the SLOs
    assert result["summary"]["attainment_mean_abs_difference_pp"] == pytest.approx(100 * sum(expected) / 4)


def test_sweeps_without_a_shared_point_get_a_clear_error(sweeps, capsys):
    for run in (sweeps / "slower" / "runs").glob("*.json"):
        data = json.loads(run.read_text())
        run.write_text(json.dumps({**data, "seed": 7}))
    assert main([str(sweeps / "first"), str(sweeps / "slower")]) == 2
    assert "share no point" in capsys.readouterr().err
