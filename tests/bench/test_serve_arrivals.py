"""Arrival times of `pdserve bench`: Poisson and gamma (burstiness) gaps have the asked mean rate, the
asked spread, and repeat with the seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.serve_arrivals import arrival_offsets

NUM = 20000


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_rate_and_spread_follow_rate_and_burstiness(burstiness):
    offsets = arrival_offsets(NUM, request_rate=8.0, burstiness=burstiness, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert (NUM - 1) / offsets[-1] == pytest.approx(8.0, rel=0.05)
    # gamma gaps with shape k: coefficient of variation 1 / sqrt(k) (1 for Poisson)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_the_seed_fixes_the_arrivals():
    first = arrival_offsets(100, 4.0, 0.5, seed=7)
    assert np.array_equal(first, arrival_offsets(100, 4.0, 0.5, seed=7))
    assert not np.array_equal(first, arrival_offsets(100, 4.0, 0.5, seed=8))


@pytest.mark.parametrize(("rate", "burstiness", "option"), [(0.0, 1.0, "--request-rate"), (-1.0, 1.0, "--request-rate"),
                                                           (2.0, 0.0, "--burstiness"), (2.0, math.nan, "--burstiness")])
def test_bad_rates_are_refused_with_the_option_named(rate, burstiness, option):
    with pytest.raises(ValueError, match=option):
        arrival_offsets(10, rate, burstiness)
