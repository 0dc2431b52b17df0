"""A run's results: the --save-result JSON (vLLM's flat keys, the run's settings, --metadata, and
per-request arrays) and the table printed at the end."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from pdserve.bench.serve_metrics import LATENCY_METRICS, STATISTICS, RequestResult, compute_metrics

# Per-request arrays, in the order the requests were sent; times in seconds, as vLLM writes them.
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "errors")
METRIC_KEYS = (*compute_metrics([], 1.0), "client_cpu_s")
PHASE_KEYS = ("phases", "request_phases")  # per-phase metrics, and each request's phase (an index into them)
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def parse_metadata(items: list[str] | None, reserved: set[str]) -> dict[str, str]:
    """--metadata k=v ... as a dict; a key may not shadow a result key."""
    metadata = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata {item!r} is not KEY=VALUE: write e.g. --metadata config=1P1D gpu=h100")
        if key in reserved:
            raise ValueError(f"--metadata key {key!r} is a result key of its own: rename it")
        metadata[key] = value
    return metadata


def build_result(metrics: dict, results: list[RequestResult], settings: dict, metadata: dict,
                 phases: list[dict] | None = None, request_phases: list[int] | None = None) -> dict:
    per_request = {
        "input_lens": [r.input_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itls for r in results],
        "e2els": [r.latency for r in results],
        "errors": [r.error for r in results],
    }
    by_phase = {"phases": phases, "request_phases": request_phases} if phases else {}
    return {**settings, **metadata, **metrics, **per_request, **by_phase}


def _json_safe(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def save_result(path: str | Path, result: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({key: _json_safe(value) for key, value in result.items()}, indent=1) + "\n")
    return out


def failure_reasons(results: list[RequestResult], limit: int = 8) -> list[tuple[int, str]]:
    """(count, reason) of the most frequent failures."""
    counts = Counter(r.error for r in results if not r.success)
    return [(count, reason) for reason, count in counts.most_common(limit)]


def _rate_text(settings: dict) -> str:
    if settings.get("phase_spec"):
        return f"by phase: {settings['phase_spec']} x {settings['phase_cycles']} cycles"
    if settings["dataset"] == "trace":
        return "the trace's arrivals"
    return str(settings["request_rate"])


def format_table(metrics: dict, settings: dict, results: list[RequestResult]) -> str:
    rows = [
        ("Server", f"{settings['base_url']}{settings['endpoint']}"),
        ("Model", settings["model_id"]),
        ("Dataset", f"{settings['dataset']}, {settings['num_prompts']} prompts"),
        ("Request rate (req/s)", f"{_rate_text(settings)}, burstiness {settings['burstiness']}"),
        ("Max concurrency", settings["max_concurrency"] or "none"),
        ("Completed / failed", f"{metrics['completed']} / {metrics['failed']}"),
        ("Duration (s)", f"{metrics['duration']:.2f}"),
        ("Total input tokens", metrics["total_input_tokens"]),
        ("Total output tokens", metrics["total_output_tokens"]),
        ("Request throughput (req/s)", f"{metrics['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics['total_token_throughput']:.2f}"),
        ("Client CPU busy", f"{100 * metrics['client_cpu_s'] / metrics['duration']:.0f}%"),
    ]
    if metrics["request_goodput"] is not None:
        slos = ", ".join(f"{name} <= {limit:g} ms" for name, limit in settings["goodput"].items())
        rows += [("Request goodput (req/s)", f"{metrics['request_goodput']:.2f} ({slos})"),
                 ("Requests meeting every SLO", f"{100 * metrics['slo_attainment']:.1f}%")]
    width = max(len(name) for name, _ in rows)
    lines = ["=" * 20 + " pdserve bench " + "=" * 20]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append("")
    lines.append(f"{'Latency (ms)':<12}" + "".join(f"{stat:>10}" for stat in STATISTICS))
    for name in LATENCY_METRICS:
        cells = "".join(f"{metrics[f'{stat}_{name}_ms']:>10.2f}" for stat in STATISTICS)
        lines.append(f"{LATENCY_NAMES[name]:<12}{cells}")
    reasons = failure_reasons(results)
    if reasons:
        lines.append("")
        lines.append("Failures:")
        lines += [f"  {count:>5} x {reason}" for count, reason in reasons]
    lines.append("=" * 55)
    return "\n".join(lines)
