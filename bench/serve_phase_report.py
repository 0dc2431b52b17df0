"""Per-phase results of a phased or trace run: each measured request counts in the phase window it arrived
in, and each window gets the run's metrics (compute_metrics) over its requests, for the JSON's `phases`
and a table under the run's own."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pdserve.bench.serve_metrics import RequestResult, compute_metrics, extra_percentiles
from pdserve.bench.serve_phases import PhaseWindow

MIN_DURATION_S = 1e-9


def _span_s(results: list[RequestResult]) -> float:
    """From the first send to the last end among these requests (a failed one ends when it was sent)."""
    if not results:
        return 0.0
    return max(r.start + (r.latency if r.success else 0.0) for r in results) - min(r.start for r in results)


def phase_results(windows: Sequence[PhaseWindow], owners: Sequence[int], indices: Sequence[int],
                  results: Sequence[RequestResult], slos_ms: dict[str, float],
                  percentile_metrics: tuple[str, ...] | None = None,
                  metric_percentiles: tuple[float, ...] | None = None) -> list[dict]:
    """One entry per window: what it is, how many requests arrived in it, and their metrics. `owners`:
    [num samples] window of each sample; `indices`: [len(results)] sample of each result. A window's
    duration runs from its first send to its last end, as the run's does (its length when none was sent)."""
    members: list[list[RequestResult]] = [[] for _ in windows]
    for index, result in zip(indices, results):
        members[owners[index]].append(result)
    sent = Counter(owners)
    entries = []
    for number, (window, group) in enumerate(zip(windows, members)):
        duration = _span_s(group) or max(window.end_s - window.start_s, MIN_DURATION_S)
        entries.append({
            "name": window.name, "phase": window.phase, "cycle": window.cycle,
            "spec": window.spec.label() if window.spec else None,
            "window_start_s": window.start_s, "window_end_s": window.end_s,
            "num_requests": sent[number],
            **compute_metrics(group, duration, slos_ms),
            **extra_percentiles(group, percentile_metrics, metric_percentiles),
        })
    return entries


def format_phase_table(phases: list[dict]) -> str:
    """A row per phase window: requests, throughput, TTFT/TPOT/ITL percentiles and SLO attainment."""
    header = ("Phase", "Spec", "Sent", "Done/failed", "Req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "ITL p99", "SLO met")
    rows = []
    for entry in phases:
        attainment = entry["slo_attainment"]
        rows.append((entry["name"], entry["spec"] or "-", str(entry["num_requests"]),
                     f"{entry['completed']}/{entry['failed']}", f"{entry['request_throughput']:.2f}",
                     *(f"{entry[key]:.1f}" for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                        "p99_tpot_ms", "p99_itl_ms")),
                     "-" if attainment is None else f"{100 * attainment:.1f}%"))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["Per phase (each request counted in the phase it arrived in; times in ms)"]
    for row in (header, *rows):
        lines.append("  ".join(cell.ljust(width) if i < 2 else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(row, widths))))
    return "\n".join(lines)
