"""What a simulated run predicts, in `pdserve bench`'s terms: latency statistics (serve_metrics.summarize), the
first ITL (the wait for the second token), SLO attainment (serve_metrics' rule: a single-token request's TPOT
counts as 0) and goodput."""

from __future__ import annotations

import numpy as np

from pdserve.planner.model.simulator import SimRequest
from pdserve.bench.serve_metrics import summarize
from pdserve.bench.sweep_results import ATTAINMENT_TARGET


def latencies_s(requests: list[SimRequest]) -> dict[str, np.ndarray]:
    """[num completed] TTFT, TPOT and E2EL of the requests that finished."""
    done = [r for r in requests if r.finish is not None]
    return {"ttft": np.array([r.ttft for r in done]), "tpot": np.array([r.tpot for r in done]),
            "e2el": np.array([r.e2el for r in done])}


def predicted_metrics(requests: list[SimRequest], slos_ms: dict[str, float]) -> dict[str, float | None]:
    """bench's figures for a simulated run: duration, throughputs, TTFT/TPOT/E2EL stats, attainment, goodput."""
    series = latencies_s(requests)
    finishes = [r.finish for r in requests if r.finish is not None]
    duration = (max(finishes) - min(r.arrival for r in requests)) if finishes else 0.0
    metrics: dict[str, float | None] = {"completed": len(finishes), "duration": duration,
                                        "request_throughput": len(finishes) / duration if duration else 0.0}
    for name, values in series.items():
        metrics.update(summarize(name, values.tolist()))
    metrics["mean_itl_ms"] = metrics["mean_tpot_ms"]  # steps of one engine: the ITLs average to the TPOT
    metrics.update(summarize("first_itl", [r.first_itl for r in requests if r.first_itl is not None]))
    met = np.ones(len(series["ttft"]), dtype=bool)
    for name, limit_ms in slos_ms.items():
        met &= series[name] * 1000.0 <= limit_ms
    num_met = int(met.sum())
    metrics["slo_attainment"] = num_met / len(requests) if slos_ms and requests else None
    metrics["request_goodput"] = num_met / duration if slos_ms and duration else None
    metrics["preemptions"] = sum(r.num_preemptions for r in requests)
    return metrics


def meets_target(metrics: dict) -> bool:
    return metrics["slo_attainment"] is not None and metrics["slo_attainment"] >= ATTAINMENT_TARGET
