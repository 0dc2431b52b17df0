"""SLOs from unloaded latencies, measured in the same sweep (`pdserve sweep --slo-factors ttft:4 tpot:1.3`):
each server first serves a few requests one at a time; every SLO is a factor times the best (lowest) median
among the servers, as DistServe and Splitwise set theirs."""

from __future__ import annotations

import math

from pdserve.bench.serve_metrics import SLO_NAMES, parse_metric_values

UNLOADED_PHASE = "unloaded"


def parse_slo_factors(items: list[str] | None) -> dict[str, float]:
    """["ttft:4", "tpot:1.3"] -> {"ttft": 4.0, "tpot": 1.3}."""
    return parse_metric_values(items, lambda factor: factor >= 1, lambda item: (
        f"--slo-factors {item!r}: give METRIC:FACTOR with METRIC one of {', '.join(SLO_NAMES)} and a factor >= 1 "
        "(an SLO below the unloaded latency cannot be met), e.g. ttft:4 tpot:1.3"))


def slos_from_unloaded(rows: list[dict], factors: dict[str, float]) -> tuple[dict[str, float], dict]:
    """(SLOs in ms, how each was derived) from the unloaded runs' rows: factor x the lowest median of the
    servers that completed their unloaded run. Raises ValueError when no server did."""
    measured = [row for row in rows if row.get("phase") == UNLOADED_PHASE and not row.get("error")
                and row.get("completed")]
    if not measured:
        raise ValueError("no server completed its unloaded run, so there is no latency to derive SLOs from: "
                         "see the errors above, or give the SLOs in milliseconds with --goodput")
    slos: dict[str, float] = {}
    basis: dict[str, dict] = {}
    for metric, factor in factors.items():
        field = f"median_{metric}_ms"
        best = min((row for row in measured if _positive(row.get(field))), key=lambda row: row[field], default=None)
        if best is None:
            raise ValueError(f"the unloaded runs measured no {metric.upper()} (every request had one output token?): "
                             f"drop {metric} from --slo-factors or raise --output-len")
        slos[metric] = float(math.ceil(factor * best[field]))  # whole ms, as --goodput takes them
        basis[metric] = {"factor": factor, "unloaded_median_ms": best[field], "from_config": best["config"],
                         "slo_ms": slos[metric]}
    return slos, basis


def goodput_flags(slos: dict[str, float]) -> list[str]:
    """{"ttft": 11100.0} -> ["ttft:11100"]: the same SLOs for `pdserve bench --goodput`."""
    return [f"{metric}:{limit:g}" for metric, limit in slos.items()]


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
