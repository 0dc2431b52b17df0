"""The attainment MAE an exact simulator would still see: binomial sampling of a point's requests."""

from __future__ import annotations

import math

import pytest

from pdserve.planner.validate.sampling import expected_sampling_error, sampling_floor_pp


def test_small_cases_in_closed_form():
    assert expected_sampling_error(1, 0.3) == pytest.approx(0.3 * 0.7 + 0.7 * 0.3)  # K = 1 or 0
    assert expected_sampling_error(2, 0.5) == pytest.approx(0.25 * 0.5 + 0.5 * 0.0 + 0.25 * 0.5)
    assert expected_sampling_error(12, 0.0) == expected_sampling_error(12, 1.0) == 0.0


def test_many_requests_approach_the_normal_mean_absolute_deviation():
    n, p = 2000, 0.5
    assert expected_sampling_error(n, p) == pytest.approx(math.sqrt(2 / math.pi) * math.sqrt(p * (1 - p) / n),
                                                          rel=0.01)
    assert expected_sampling_error(12, 0.5) > 2 * expected_sampling_error(48, 0.5) * 0.9  # ~1 / sqrt(n)


def test_the_floor_averages_the_points_with_a_measurement():
    rows = [{"num_requests": 2, "predicted_slo_attainment": 0.5, "measured_slo_attainment": 1.0},
            {"num_requests": 12, "predicted_slo_attainment": 1.0, "measured_slo_attainment": 0.5},
            {"num_requests": 12, "predicted_slo_attainment": 0.5, "measured_slo_attainment": None}]
    assert sampling_floor_pp(rows) == pytest.approx(100 * (0.25 + 0.0) / 2)
    assert sampling_floor_pp(rows[2:]) is None
