"""`pdserve plan` and `pdserve plan --validate` give the same numbers on committed inputs (tests/planner/data: a CPU
profile, a GPU profile, and the runs of one CPU sweep of 0P2D and 1P1D at three rates, with reference runs and
unloaded passes). A change meant to move a prediction updates these numbers in the same commit and says why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.cli import main

DATA = Path(__file__).resolve().parent / "data"
CPU, GPU, SWEEP = str(DATA / "profile-cpu.json"), str(DATA / "profile-gpu.json"), str(DATA / "prefill-heavy")
SHORT_PROMPTS = ["--num-prompts", "100", "--input-len", "1000", "--output-len", "32"]
PLANS = {
    "plan_cpu_rate": ["--profile", CPU, "--engines", "3", "--slo", "ttft:8000", "tpot:150", *SHORT_PROMPTS,
                      "--request-rate", "0.2", "--step-scale", "1.1", "0.9"],
    "plan_cpu_goodput": ["--profile", CPU, "--engines", "2", "--slo", "ttft:8000", "tpot:150", "--num-prompts", "60",
                         "--input-len", "1000", "--output-len", "32", "--jobs", "1", "--host-cpu-per-token", "500",
                         "--host-background-cpu", "0.01"],
    "plan_gpu_rate": ["--profile", GPU, "--engines", "4", "--slo", "ttft:2000", "tpot:50", "--num-prompts", "200",
                      "--request-rate", "8"],
}
VALIDATIONS = {
    "validate": ["--profile", CPU, "--validate", SWEEP],
    "validate_per_point": ["--profile", CPU, "--validate", SWEEP, "--per-point-speed"],
    "validate_no_host": ["--profile", CPU, "--validate", SWEEP, "--host-cpu-per-token", "0"],
}
SPLIT_KEYS = ("config", "request_rate", "slo_attainment", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms",
              "p90_tpot_ms", "goodput")
PREDICTED = ("predicted_slo_attainment", "predicted_median_ttft_ms", "predicted_p90_ttft_ms",
             "predicted_median_tpot_ms", "predicted_p90_tpot_ms", "predicted_median_first_itl_ms")
DIAGNOSTICS = ("slo_attainment_with_measured", "measured_step_ratio", "prefill_busy_ratio", "reference_speed_prefill",
               "reference_speed_decode")

EXPECTED = {'plan_cpu_rate': {'recommended': '2P1D',
                   'splits': [['0P3D', 0.2, 0.92, 4148.62, 4148.62, 52.861, 64.3287, 0.1747],
                              ['1P2D', 0.2, 0.3, 11018.5, 18254.0, 58.1893, 69.6527, 0.0561657],
                              ['2P1D', 0.2, 1.0, 4148.62, 6593.97, 55.8318, 67.7548, 0.189751]]},
 'plan_cpu_goodput': {'recommended': '0P2D',
                      'splits': [['0P2D', 0.0793157, 0.916667, 3771.47, 3790.92, 58.6622, 71.937, 0.0793157],
                                 ['1P1D', 0.0743254, 0.916667, 3771.47, 7604.16, 61.6546, 63.8847, 0.0743254]]},
 'plan_gpu_rate': {'recommended': '0P4D',
                   'splits': [['0P4D', 8.0, 1.0, 36.6754, 36.6754, 2.62993, 3.04792, 7.89886],
                              ['1P3D', 8.0, 0.18, 10595.0, 21565.6, 4.1916, 5.15097, 0.713401],
                              ['2P2D', 8.0, 1.0, 36.6754, 36.6754, 6.43911, 8.34573, 7.8098],
                              ['3P1D', 8.0, 0.94, 36.6754, 36.6754, 27.3268, 46.4565, 6.87204]]},
 'validate': {'points': [['0P2D', 0.1, 0.833333, 3771.47, 4087.03, 60.9042, 152.244, 58.7294],
                         ['0P2D', 0.2, 0.333333, 4244.33, 10728.7, 127.973, 248.661, 1900.0],
                         ['0P2D', 0.3, 0.375, 3849.72, 7318.28, 153.559, 340.52, 85.8027],
                         ['1P1D', 0.1, 1.0, 3787.39, 9126.93, 60.8955, 76.5992, 164.324],
                         ['1P1D', 0.2, 0.333333, 15949.9, 26878.2, 76.5992, 76.5992, 231.697],
                         ['1P1D', 0.3, 0.375, 16380.3, 23826.8, 76.5992, 76.5992, 231.697]],
              'attainment_mae_pp': 8.33333,
              'goodput': [[{'0P2D': 0.0, '1P1D': 0.1}, {'0P2D': 0.0, '1P1D': 0.1}, '1P1D']],
              'host_cpu_us_per_token': {'0P2D': 384.713, '1P1D': 536.842},
              'diagnostics': [[{'ttft': 0.833333, 'first_itl': 0.833333, 'later_itls': 0.791667},
                               1.14788,
                               None,
                               0.982826,
                               1.04528],
                              [{'ttft': 0.333333, 'first_itl': 0.333333, 'later_itls': 0.208333},
                               1.31391,
                               None,
                               0.973113,
                               1.06845],
                              [{'ttft': 0.375, 'first_itl': 0.375, 'later_itls': 0.333333},
                               1.22894,
                               None,
                               0.957005,
                               1.02638],
                              [{'ttft': 1.0, 'first_itl': 1.0, 'later_itls': 1.0}, 1.0692, 0.998636, 1.00081, 1.05878],
                              [{'ttft': 0.25, 'first_itl': 0.333333, 'later_itls': 0.25},
                               1.09362,
                               1.02795,
                               1.00661,
                               1.08575],
                              [{'ttft': 0.458333, 'first_itl': 0.375, 'later_itls': 0.375},
                               1.07396,
                               1.00445,
                               0.984766,
                               1.0868]],
              'unloaded': [{'config': '0P2D',
                            'measured_ttft_ms': 3662.8,
                            'profile_prefill_ms': 3771.47,
                            'measured_tpot_ms': 59.7459,
                            'simulated_tpot_ms': 58.3052,
                            'measured_first_itl_ms': 57.4661,
                            'simulated_first_itl_ms': 58.0816,
                            'measured_later_itl_ms': 58.8819,
                            'profile_decode_step_ms': 58.3052},
                           {'config': '1P1D',
                            'measured_ttft_ms': 3599.55,
                            'profile_prefill_ms': 3771.47,
                            'measured_tpot_ms': 62.2986,
                            'simulated_tpot_ms': 60.5656,
                            'measured_first_itl_ms': 150.935,
                            'simulated_first_itl_ms': 164.324,
                            'measured_later_itl_ms': 59.4729,
                            'profile_decode_step_ms': 58.3052}]},
 'validate_per_point': {'points': [['0P2D', 0.1, 0.833333, 3706.7, 3969.31, 63.7117, 154.332, 61.3715],
                                   ['0P2D', 0.2, 0.291667, 4008.09, 10427.0, 133.062, 262.992, 1858.61],
                                   ['0P2D', 0.3, 0.416667, 3673.01, 8997.61, 122.869, 320.307, 88.1107],
                                   ['1P1D', 0.1, 1.0, 3790.45, 9138.18, 64.3537, 80.8397, 167.738],
                                   ['1P1D', 0.2, 0.333333, 16430.7, 27903.5, 82.7856, 82.7856, 237.845],
                                   ['1P1D', 0.3, 0.458333, 15743.5, 22760.6, 82.861, 82.861, 237.92]],
                        'attainment_mae_pp': 6.94444,
                        'goodput': [[{'0P2D': 0.0, '1P1D': 0.1}, {'0P2D': 0.0, '1P1D': 0.1}, '1P1D']],
                        'host_cpu_us_per_token': {'0P2D': 384.713, '1P1D': 536.842}},
 'validate_no_host': {'points': [['0P2D', 0.1, 0.833333, 3771.47, 4061.75, 60.2976, 151.223, 58.0816],
                                 ['0P2D', 0.2, 0.416667, 4217.91, 10675.6, 126.986, 246.276, 1889.9],
                                 ['0P2D', 0.3, 0.375, 3810.8, 7249.97, 152.104, 337.145, 85.0324],
                                 ['1P1D', 0.1, 1.0, 3771.47, 9126.93, 60.5656, 75.2325, 164.324],
                                 ['1P1D', 0.2, 0.333333, 15949.9, 26878.2, 75.2325, 75.2325, 230.332],
                                 ['1P1D', 0.3, 0.375, 16380.3, 23826.8, 75.2325, 75.2325, 230.332]],
                      'attainment_mae_pp': 9.72222,
                      'goodput': [[{'0P2D': 0.0, '1P1D': 0.1}, {'0P2D': 0.0, '1P1D': 0.1}, '1P1D']],
                      'host_cpu_us_per_token': {'0P2D': 0.0, '1P1D': 0.0}}}


def run_plan(tmp_path: Path, args: list[str], result_file: str) -> dict:
    out = tmp_path / "out"
    assert main(["plan", *args, "--output-dir", str(out), "--no-plots"]) == 0
    return json.loads((out / result_file).read_text())


def assert_close(actual, expected, where: str = "") -> None:
    """Equal structure and strings; numbers within 1e-5 (the pinned ones have 6 significant digits)."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), where
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert math.isclose(actual, expected, rel_tol=1e-5, abs_tol=1e-9), f"{where}: {actual} != {expected}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_recommends_and_predicts_as_pinned(tmp_path, name):
    plan = run_plan(tmp_path, PLANS[name], "plan.json")
    actual = {"recommended": (plan["recommended"] or {}).get("config"),
              "splits": [[row[key] for key in SPLIT_KEYS] for row in plan["splits"]]}
    assert_close(actual, {key: EXPECTED[name][key] for key in ("recommended", "splits")}, name)


@pytest.mark.parametrize("name", sorted(VALIDATIONS))
def test_validate_predicts_each_point_as_pinned(tmp_path, name):
    validation = run_plan(tmp_path, VALIDATIONS[name], "validation.json")
    summary, expected = validation["summary"], EXPECTED[name]
    actual = {"points": [[p["config"], p["request_rate"], *[p[key] for key in PREDICTED]] for p in validation["points"]],
              "attainment_mae_pp": summary["attainment_mae_pp"],
              "goodput": [[g["measured"], g["predicted"], g["predicted_best"]] for g in summary["goodput"]],
              "host_cpu_us_per_token": {c: h["seconds_per_token"] * 1e6 for c, h in summary["host_cpu"].items()}}
    assert_close(actual, {key: expected[key] for key in actual}, name)


def test_validate_diagnostics_are_pinned(tmp_path):
    validation = run_plan(tmp_path, [*VALIDATIONS["validate"], "--diagnose"], "validation.json")
    actual = {"diagnostics": [[p[key] for key in DIAGNOSTICS] for p in validation["points"]],
              "unloaded": validation["summary"]["unloaded"]}
    assert_close(actual, {key: EXPECTED["validate"][key] for key in actual}, "validate")
