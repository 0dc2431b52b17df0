"""When each benchmark request is sent: all at once (rate inf), or a Poisson process whose burstiness
is set by gamma-distributed gaps (shape = burstiness, mean = 1 / rate), as vLLM bench serve does.

burstiness 1 is Poisson (exponential gaps); below 1 the arrivals come in bursts, above 1 more evenly.
"""

from __future__ import annotations

import math

import numpy as np


def check_arrival_args(request_rate: float, burstiness: float) -> None:
    if not request_rate > 0:
        raise ValueError(f"--request-rate {request_rate} must be above 0 (requests per second), or inf")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness {burstiness} must be a positive number (1 = Poisson)")


MAX_ARRIVAL_SPAN_S = 86_400.0  # bench's bound on a run's expected arrivals: a day; more is a mistyped rate


def check_arrival_span(num_requests: int, request_rate: float) -> None:
    """bench's check that its arrivals end in a day: the last of num_requests comes after num_requests - 1
    gaps of mean 1 / rate (`pdserve plan` simulates its arrivals, so it does not make this check)."""
    span = (num_requests - 1) / request_rate
    if span > MAX_ARRIVAL_SPAN_S:
        raise ValueError(f"--request-rate {request_rate} spreads --num-prompts {num_requests} over about {span:.3g} s "
                         f"of arrivals, more than a day ({MAX_ARRIVAL_SPAN_S:.0f} s): raise --request-rate, or use inf "
                         "for all at once")


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """[num_requests] seconds after the start at which each request is sent; the first at 0."""
    check_arrival_args(request_rate, burstiness)
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    rng = np.random.default_rng([seed, 1])  # a stream apart from the datasets' (seeded by seed alone)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))
