"""What one benchmark request measured (RequestResult), and the run's metrics under vLLM bench serve's
names and definitions (docs/benchmarking/bench.md).

Times in a RequestResult are seconds; the metrics are milliseconds (`*_ms`) or per second.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "std", "p90", "p95", "p99")
SLO_NAMES = ("ttft", "tpot", "e2el")


def parse_slos(items: list[str] | None, flag: str = "--goodput") -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); errors name `flag`."""
    return parse_metric_values(items, lambda ms: ms > 0, lambda item: (
        f"{flag} {item!r}: give METRIC:MILLISECONDS with METRIC one of {', '.join(SLO_NAMES)} and a positive "
        "number, e.g. ttft:500 tpot:50"))


def parse_metric_values(items: list[str] | None, accepts: Callable[[float], bool],
                        problem: Callable[[str], str]) -> dict[str, float]:
    """["ttft:4", ...] -> {"ttft": 4.0, ...}: each item METRIC:VALUE with METRIC one of SLO_NAMES and a finite
    VALUE that `accepts` takes, else a ValueError saying problem(item)."""
    values: dict[str, float] = {}
    for item in items or []:
        name, sep, text = item.partition(":")
        name = name.strip().lower()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not sep or name not in SLO_NAMES or not math.isfinite(value) or not accepts(value):
            raise ValueError(problem(item))
        values[name] = value
    return values


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""  # why it failed: "HTTP 500: ...", "connection dropped: ...", "stalled: ..."
    input_len: int = 0  # prompt tokens (the server's usage; the dataset's count without one)
    output_len: int = 0  # generated tokens (the server's usage; the tokenizer's count without one)
    ttft: float = 0.0  # s from sending the request to the first chunk that carries text
    itls: list[float] = field(default_factory=list)  # s between consecutive chunks that carry text
    latency: float = 0.0  # e2el: s from sending the request to the end of its stream
    start: float = 0.0  # perf_counter() when it was sent


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first, vLLM's (e2el - ttft) / (output_len - 1); None for a single token."""
    if result.output_len <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def summarize(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std/p90/p95/p99 of values in seconds, as `{stat}_{name}_ms`; 0.0 for none (as vLLM)."""
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if values_ms.size == 0:
        return {f"{stat}_{name}_ms": 0.0 for stat in STATISTICS}
    return {
        f"mean_{name}_ms": float(np.mean(values_ms)),
        f"median_{name}_ms": float(np.median(values_ms)),
        f"std_{name}_ms": float(np.std(values_ms)),
        **{f"p{q}_{name}_ms": float(np.percentile(values_ms, q)) for q in (90, 95, 99)},
    }


def latency_series(done: list[RequestResult]) -> dict[str, list[float]]:
    """Each latency metric's values in seconds over the completed requests (ITL: every gap of every request)."""
    return {"ttft": [r.ttft for r in done], "tpot": [value for value in map(tpot, done) if value is not None],
            "itl": [itl for r in done for itl in r.itls], "e2el": [r.latency for r in done]}


def extra_percentiles(results: list[RequestResult], names: tuple[str, ...] | None,
                      percentiles: tuple[float, ...] | None) -> dict[str, float]:
    """vLLM's --metric-percentiles as `p{P}_{metric}_ms` keys (p99.9_ttft_ms), for the --percentile-metrics
    named (default: all); the ones always written (p90, p95, p99) are not repeated. 0.0 without values."""
    series = latency_series([r for r in results if r.success])
    extra = {}
    for name in names or LATENCY_METRICS:
        values_ms = np.asarray(series[name], dtype=np.float64) * 1000.0
        for q in percentiles or ():
            key = f"p{q:g}_{name}_ms"
            if q not in (90, 95, 99):
                extra[key] = float(np.percentile(values_ms, q)) if values_ms.size else 0.0
    return extra


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request is within every SLO given (a single-token request's TPOT counts as 0)."""
    measured_ms = {"ttft": result.ttft * 1000.0, "tpot": (tpot(result) or 0.0) * 1000.0,
                   "e2el": result.latency * 1000.0}
    return all(measured_ms[name] <= limit for name, limit in slos_ms.items())


def compute_metrics(results: list[RequestResult], duration_s: float,
                    slos_ms: dict[str, float] | None = None) -> dict[str, float | int | None]:
    """The run's flat metrics: counts, throughputs, latency statistics and, with SLOs, goodput.

    Only completed requests enter the token counts and latencies; failed ones count in `failed` and
    as misses in `slo_attainment` (the share of all requests sent that met every SLO)."""
    done = [r for r in results if r.success]
    total_input = sum(r.input_len for r in done)
    total_output = sum(r.output_len for r in done)
    metrics: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": None,
        "slo_attainment": None,
    }
    if slos_ms:
        num_good = sum(meets_slos(r, slos_ms) for r in done)
        metrics["request_goodput"] = num_good / duration_s
        metrics["slo_attainment"] = num_good / len(results) if results else 0.0
    series = latency_series(done)
    for name in LATENCY_METRICS:
        metrics.update(summarize(name, series[name]))
    return metrics
