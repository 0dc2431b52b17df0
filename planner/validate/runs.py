"""A `pdserve sweep` directory's runs as `pdserve plan --validate` reads them: the run JSONs, the ones a replay can
simulate, and what each measured (SLO attainment, p50/p90 TTFT and TPOT, the first ITL)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from pdserve.bench.sweep_results import request_latencies_ms, slo_attainment
from pdserve.planner.profile.fit import Profile, model_identity

FIRST_ITL = "median_first_itl_ms"  # the wait for the second token: a disaggregated request's KV transfer
REPLAYED_KEYS = ("config", "request_rate", "input_lens", "output_lens")  # what a replay reads from a run


def load_runs(sweep_dir: Path) -> list[dict]:
    """Every run JSON of a sweep directory."""
    runs_dir = sweep_dir / "runs"
    files = sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else []
    if not files:
        raise ValueError(f"{sweep_dir} has no runs/*.json: pass the output directory of a `pdserve sweep`")
    return [load_run(path) for path in files]


def load_run(path: Path) -> dict:
    """One run JSON as `pdserve bench --save-result` writes it; ValueError naming the file otherwise."""
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise ValueError(f"cannot read the sweep run {path} ({exc}): remove it, or run the sweep again") from None
    if not isinstance(run, dict):
        raise ValueError(f"{path} is not a sweep run (a JSON {type(run).__name__}, not an object): remove it, or run "
                         f"the sweep again")
    return run


def read_runs(all_runs: list[dict], sweep_dir: Path) -> list[dict]:
    """The runs to replay: pdserve layouts at a finite request rate."""
    runs = []
    for run in all_runs:
        sweep = run.get("sweep") or {}
        if sweep.get("num_decode") is None or not run.get("ttfts"):
            continue  # an external server's run, or one that failed before any request
        if str(run.get("config", "")).startswith("adaptive"):
            continue  # dual-role engines: the replay simulates fixed roles
        missing = [key for key in REPLAYED_KEYS if key not in run] + [
            f"sweep.{key}" for key in ("num_prefill", "num_engines") if key not in sweep]
        if missing:
            raise ValueError(f"a run of {run.get('config', '?')} in {sweep_dir}/runs lacks {', '.join(missing)}: it "
                             f"is not what `pdserve sweep` writes; remove it, or run the sweep again")
        if run.get("max_concurrency") is not None or not math.isfinite(float(run["request_rate"])):
            continue  # a concurrency-capped load: the simulator sends at arrival times only
        runs.append(run)
    if not runs:
        raise ValueError(f"{sweep_dir}/runs has no pdserve layout run at a finite request rate to replay")
    return runs


def of_config(runs: list[dict], config: str) -> list[dict]:
    return [run for run in runs if run.get("config") == config]


def check_run_model(profile: Profile, run: dict) -> None:
    """The sweep's model is the profile's (where the run names a directory here), and its engines computed in the
    profile's dtype (where both are known: a sweep before pdserve recorded it, or such a profile, is not checked)."""
    model_dir = Path(run.get("model_id") or "")
    if (model_dir / "config.json").is_file():
        profile.check_model(model_identity(model_dir, profile.model.dtype), f"the sweep's model {model_dir}")
    sweep = run.get("sweep") or {}
    profile.check_dtype(sweep.get("dtype"), f"the sweep's {sweep.get('config', '?')} engines")


def completed(run: dict) -> list[int]:
    return [i for i, error in enumerate(run.get("errors") or [""] * len(run["ttfts"])) if not error]


def first_itls_ms(run: dict, done: list[int]) -> list[float]:
    """Each completed request's first ITL (bench writes ITLs in seconds): its second token's wait."""
    itls = run.get("itls") or []
    return [1000.0 * itls[i][0] for i in done if i < len(itls) and itls[i]]


def later_itls_ms(run: dict, done: list[int]) -> list[float]:
    """Each completed request's median ITL after the first: its decode steps once it is in the batch."""
    itls = run.get("itls") or []
    return [1000.0 * float(np.median(itls[i][1:])) for i in done if i < len(itls) and len(itls[i]) > 1]


def median_or_none(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def run_slos(run: dict) -> dict[str, float]:
    """The SLOs a run was judged by (bench's --goodput), in ms."""
    return {name: float(value) for name, value in (run.get("goodput") or {}).items()}


def measured_metrics(run: dict, slos: dict[str, float]) -> dict:
    done = completed(run)
    latencies = [request_latencies_ms(run, i) for i in done]
    metrics = {"slo_attainment": slo_attainment(run, slos)}
    for name in ("ttft", "tpot"):
        values = [lat[name] for lat in latencies]
        metrics[f"median_{name}_ms"] = median_or_none(values)
        metrics[f"p90_{name}_ms"] = float(np.percentile(values, 90)) if values else None
    metrics[FIRST_ITL] = median_or_none(first_itls_ms(run, done))
    return metrics
