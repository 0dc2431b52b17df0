"""How far a perfect model's SLO attainment would still land from a measured one. A sweep point measures n
requests, each meeting the SLOs or not, so its attainment is a binomial sample of the true share: the expected
|measured - true| is the floor of `plan --validate`'s attainment MAE at that many requests per point. Requests of
one run share queues and the machine's moments, so they are not independent, and the real floor is higher."""

from __future__ import annotations

import math

import numpy as np


def expected_sampling_error(num_requests: int, share: float) -> float:
    """E|K / n - p| for K ~ Binomial(n, p): 0 at p = 0 or 1, largest near p = 1/2 (~0.4 / sqrt(n))."""
    if num_requests < 1 or share <= 0.0 or share >= 1.0:
        return 0.0
    k = np.arange(num_requests + 1)
    log_pmf = (math.lgamma(num_requests + 1) - np.array([math.lgamma(i + 1) + math.lgamma(num_requests - i + 1)
                                                         for i in k])
               + k * math.log(share) + (num_requests - k) * math.log1p(-share))
    return float(np.sum(np.exp(log_pmf) * np.abs(k / num_requests - share)))


def sampling_floor_pp(rows: list[dict]) -> float | None:
    """The mean over points of the expected sampling error at the predicted attainment, in percentage points:
    what the attainment MAE would be if the simulator were exact."""
    errors = [expected_sampling_error(int(row["num_requests"]), float(row["predicted_slo_attainment"]))
              for row in rows if row["measured_slo_attainment"] is not None]
    return 100 * float(np.mean(errors)) if errors else None
