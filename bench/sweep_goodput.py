"""DistServe's goodput of one server: the highest request rate at which at least 90% of requests meet every
SLO, found by bracketing (from rates already measured, else by doubling or halving) then bisection."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.bench.sweep_results import ATTAINMENT_TARGET


@dataclass
class GoodputSearch:
    rate: float  # highest rate that met the target (0 = none did)
    upper_bound: float | None  # lowest rate that missed it (None = never missed: goodput is at least `rate`)
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment) in the order run


def find_goodput(attainment_at: Callable[[float], float], start_rate: float, known: dict[float, float] | None = None,
                 steps: int = 5, max_doublings: int = 8, target: float = ATTAINMENT_TARGET) -> GoodputSearch:
    """attainment_at(rate) runs a load and returns the share of requests meeting the SLOs (assumed to fall as
    the rate grows). `known` holds attainments already measured; `steps` bisections follow the bracketing."""
    if start_rate <= 0 or steps < 0 or max_doublings < 1:
        raise ValueError(f"goodput search: start rate {start_rate:g}, steps {steps}, doublings {max_doublings}: "
                         f"give a start rate > 0, steps >= 0 and doublings >= 1")
    search = GoodputSearch(0.0, None)
    measured = dict(known or {})

    def passes(rate: float) -> bool:
        if rate not in measured:
            measured[rate] = attainment_at(rate)
            search.probes.append((rate, measured[rate]))
        return measured[rate] >= target

    lower, upper = _bracket_from(measured, target)
    if lower is None and upper is None:
        lower, upper = (start_rate, None) if passes(start_rate) else (None, start_rate)
    if upper is None:  # nothing missed yet: double until something does
        for _ in range(max_doublings):
            rate = lower * 2
            if not passes(rate):
                upper = rate
                break
            lower = rate
        else:
            search.rate = lower
            return search
    if lower is None:  # nothing met the target yet: halve until something does
        for _ in range(max_doublings):
            rate = upper / 2
            if passes(rate):
                lower = rate
                break
            upper = rate
        else:
            search.upper_bound = upper
            return search
    for _ in range(steps):
        middle = (lower + upper) / 2
        lower, upper = (middle, upper) if passes(middle) else (lower, middle)
    search.rate, search.upper_bound = lower, upper
    return search


def _bracket_from(measured: dict[float, float], target: float) -> tuple[float | None, float | None]:
    """(highest passing rate, lowest failing rate above it) among rates already measured."""
    passing = [rate for rate, attainment in measured.items() if attainment >= target]
    lower = max(passing) if passing else None
    failing = [rate for rate, attainment in measured.items()
               if attainment < target and (lower is None or rate > lower)]
    return lower, (min(failing) if failing else None)
