"""What `pdserve sweep` makes of each `pdserve bench` result: SLO attainment from the per-request arrays,
one summary row per run (bench's main figures + the scraped /metrics figures), summary.csv and goodput.csv."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.sweep_metrics import SUMMARY_FIELDS

ATTAINMENT_TARGET = 0.9  # DistServe's goodput: the highest rate at which >= 90% of requests meet the SLOs
LATENCY_FIELDS = [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
                  for stat in ("mean", "median", "p90", "p99")]
BENCH_FIELDS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "request_goodput", *LATENCY_FIELDS]
RUN_FIELDS = ["config", "num_prefill", "num_decode", "num_engines", "phase", "request_rate", "max_concurrency"]
SUMMARY_COLUMNS = [*RUN_FIELDS, *BENCH_FIELDS, "slo_attainment", *SUMMARY_FIELDS, "result_file", "error"]
GOODPUT_COLUMNS = ["config", "num_engines", "goodput", "goodput_per_engine", "source", "upper_bound"]
REFERENCE_PHASE = "reference"  # a sweep's reference runs: the machine's speed around each load (validate/speed.py)


def request_latencies_ms(result: dict, index: int) -> dict[str, float]:
    """One request's TTFT, TPOT (vLLM's: (e2el - ttft) / (output_len - 1)) and E2EL in ms, from the arrays
    (seconds, as vLLM writes them; E2EL from "e2els", else TTFT plus the ITLs)."""
    ttft = result["ttfts"][index] * 1000.0
    e2els = result.get("e2els")
    e2el = e2els[index] * 1000.0 if e2els else ttft + sum(result["itls"][index]) * 1000.0
    output_len = result["output_lens"][index]
    tpot = (e2el - ttft) / (output_len - 1) if output_len > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el}


def slo_attainment(result: dict, slos: dict[str, float]) -> float | None:
    """The share of all requests (failed ones count as misses) meeting every SLO; None without SLOs."""
    if not slos:
        return None
    errors = result.get("errors") or [""] * len(result.get("ttfts", []))
    if not errors:
        return None
    met = 0
    for index, error in enumerate(errors):
        if error:
            continue
        latencies = request_latencies_ms(result, index)
        met += all(latencies[name] <= limit for name, limit in slos.items())
    return met / len(errors)


@dataclass(frozen=True)
class RunInfo:
    """Where a run sits in the sweep: which server, which load."""
    config: str
    num_engines: int
    phase: str  # "sweep" (a listed load), "search" (a goodput-search probe), "unloaded" (one at a time, for SLOs),
    # "reference" (one at a time around each load: the machine's speed) or "warmup_<phase>" (unmeasured, before a
    # server's first run of that phase)
    request_rate: float
    max_concurrency: int | None
    num_prefill: int | None = None  # None for an external server
    num_decode: int | None = None
    dtype: str | None = None  # what pdserve's engines computed in; None for an external server


def summary_row(info: RunInfo, result: dict | None, metrics: dict, slos: dict[str, float], result_file: str,
                error: str = "") -> dict:
    row = {"config": info.config, "num_prefill": info.num_prefill, "num_decode": info.num_decode,
           "num_engines": info.num_engines, "phase": info.phase, "request_rate": info.request_rate,
           "max_concurrency": info.max_concurrency}
    result = result or {}
    row.update({name: result.get(name) for name in BENCH_FIELDS})
    row["slo_attainment"] = slo_attainment(result, slos) if result else None
    row.update({name: metrics.get(name) for name in SUMMARY_FIELDS})
    row.update(result_file=result_file, error=error)
    return row


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({name: "" if row.get(name) is None else row[name] for name in columns})


def read_csv(path: Path) -> list[dict]:
    """summary.csv back as rows with numbers as floats and empty cells as None (for plots)."""
    with open(path, newline="") as file:
        return [{name: _number(value) for name, value in row.items()} for row in csv.DictReader(file)]


def _number(text: str) -> float | str | None:
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return text


def goodput_from_rows(rows: list[dict], config: str) -> tuple[float, float | None] | None:
    """(the highest finite rate of a config's runs whose attainment is >= 90% (0 when none is), the lowest
    rate above it that missed (None: none did)); None without a measured attainment."""
    measured = [(row["request_rate"], row["slo_attainment"]) for row in rows
                if row["config"] == config and row["slo_attainment"] is not None
                and row["request_rate"] is not None and math.isfinite(row["request_rate"])]
    if not measured:
        return None
    goodput = max((rate for rate, attainment in measured if attainment >= ATTAINMENT_TARGET), default=0.0)
    missed = [rate for rate, attainment in measured if attainment < ATTAINMENT_TARGET and rate > goodput]
    return goodput, min(missed, default=None)
