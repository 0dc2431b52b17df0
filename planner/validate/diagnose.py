"""`pdserve plan --validate --diagnose`: where a validation's misses come from. Per point: the decode steps under
load against the profile's step for their batch (step_check.py), the one prefill engine's busy time against the
simulated (prefill_check.py), the machine's speed around it from the sweep's reference runs (speed.py), and the
attainment with one piece of every request measured instead of predicted (error_pieces.py). For the sweep: their
ranges, and its unloaded passes against the profile (the machine's drift between the two)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pdserve.bench.sweep_results import request_latencies_ms
from pdserve.bench.sweep_unloaded import UNLOADED_PHASE
from pdserve.planner.model.host_effects import NO_HOST_EFFECTS, HostEffects
from pdserve.planner.model.simulator import ClusterSpec, SimRequest, StepModel, simulate
from pdserve.planner.search.recommend import PlanSettings
from pdserve.planner.validate.error_pieces import PIECE_TITLES, PIECES, attainment_with_measured
from pdserve.planner.validate.prefill_check import prefill_busy_ratio
from pdserve.planner.validate.runs import completed, first_itls_ms, later_itls_ms, median_or_none
from pdserve.planner.validate.speed import Speed
from pdserve.planner.validate.step_check import step_ratio

COLUMNS = (("measured_step_ratio", "step meas/prof", "{:.2f}"), ("prefill_busy_ratio", "busy P meas/sim", "{:.2f}"))
REFERENCE_COLUMNS = (("reference_speed_prefill", "ref P", "{:.2f}"), ("reference_speed_decode", "ref D", "{:.2f}"))


def point_diagnostics(run: dict, requests: list[SimRequest], settings: PlanSettings, speed: Speed | None) -> dict:
    """One replayed point's diagnostics, from the run's own arrays and its simulated requests."""
    sweep = run["sweep"]
    return {"slo_attainment_with_measured": attainment_with_measured(run, requests, settings.slos_ms),
            "measured_step_ratio": step_ratio(run, settings.model, int(sweep["num_decode"]), settings.effects),
            "prefill_busy_ratio": prefill_busy_ratio(run, requests, int(sweep["num_prefill"])),
            "reference_speed_prefill": speed.prefill if speed else None,
            "reference_speed_decode": speed.decode if speed else None}


def summarize(rows: list[dict], unloaded: list[dict]) -> dict:
    """The sweep's diagnostics: the attainment MAE per measured piece, each ratio's range, the unloaded passes."""
    summary = {"attainment_mae_pp_with_measured":
               mae_with_measured([r for r in rows if r["measured_slo_attainment"] is not None])}
    for key, name in (("measured_step_ratio", "step_ratio_range"), ("prefill_busy_ratio", "prefill_busy_ratio_range")):
        ratios = [r[key] for r in rows if r.get(key) is not None]
        summary[name] = [min(ratios), max(ratios)] if ratios else None
    for side in ("prefill", "decode"):
        speeds = [r[f"reference_speed_{side}"] for r in rows if r[f"reference_speed_{side}"] is not None]
        summary[f"reference_speed_{side}_range"] = [min(speeds), max(speeds)] if speeds else None
    summary["unloaded"] = unloaded
    return summary


DIAGNOSE_LEGEND = ("TTFT p90, TPOT p90: the 90th percentiles (ms)",
                   "step meas/prof: decode steps under load (from the ITLs) over the profile's step for their batch",
                   "busy P meas/sim: the prefill engine's busy time, as its first tokens show it, over the simulated "
                   "(one prefill engine)",
                   "ref P, ref D: the reference runs around the point over the profile, prefill and decode "
                   "(1.2 = 20% slower)")


def print_diagnostics(summary: dict, per_point_speed: bool) -> None:
    print("diagnostics (--diagnose):\n" + "\n".join(f"  {line}" for line in DIAGNOSE_LEGEND))
    pieces = summary["attainment_mae_pp_with_measured"]
    if pieces:
        print("  attainment MAE with one piece of every request measured instead of predicted: "
              + ", ".join(f"{PIECE_TITLES[piece]} {mae:.1f} pp" for piece, mae in pieces.items()))
    if summary["step_ratio_range"]:
        low, high = summary["step_ratio_range"]
        print(f"  decode steps under load against the profile's step for their batch (step_check.py): "
              f"x{low:.2f} to x{high:.2f} (the machine's drift and the step model's error)")
    if summary.get("prefill_busy_ratio_range"):
        low, high = summary["prefill_busy_ratio_range"]
        print(f"  the prefill engine's busy time under load against the simulated (one prefill engine; "
              f"prefill_check.py): x{low:.2f} to x{high:.2f} (the machine's drift and the prefill model's error)")
    if summary["reference_speed_prefill_range"]:
        ranges = {side: summary[f"reference_speed_{side}_range"] for side in ("prefill", "decode")}
        print("  the reference runs around each point against the profile (the machine's speed of the moment): "
              + ", ".join(f"{side} x{low:.2f} to x{high:.2f}" for side, (low, high) in
                          ((side, r) for side, r in ranges.items() if r))
              + ("; the steps were scaled by them (--per-point-speed)" if per_point_speed else ""))
    print_drift(summary["unloaded"])


def read_unloaded(all_runs: list[dict]) -> list[dict]:
    """The sweep's unloaded passes (one request at a time per layout): how fast the machine was during the sweep,
    to hold against the profile's own figures."""
    return [run for run in all_runs if run.get("phase") == UNLOADED_PHASE and run.get("ttfts")]


def unloaded_drift(runs: list[dict], model: StepModel, cluster: ClusterSpec,
                   effects: HostEffects = NO_HOST_EFFECTS) -> list[dict]:
    """Per unloaded pass: its median TTFT against the profile's prefill step for its mean prompt; its median TPOT
    against the simulator's TPOT for that request alone on the pass's layout, which holds the first ITL (1P1D: the
    KV transfer); its median first ITL against the simulator's; its later ITLs against the profile's decode step at
    batch 1 (context: the prompt and half the output). Their ratios are the machine's drift between the profile
    and the sweep, which every prediction inherits; a first ITL off by more than that is the model's error."""
    rows = []
    for run in runs:
        done = completed(run)
        latencies = [request_latencies_ms(run, i) for i in done]
        if not latencies:
            continue
        prompt, output = float(np.mean(run["input_lens"])), float(np.mean(run["output_lens"]))
        alone = alone_on_layout(run, model, cluster, effects, round(prompt), round(output)) if run.get("sweep") \
            else None
        rows.append({"config": run["config"],
                     "measured_ttft_ms": float(np.median([lat["ttft"] for lat in latencies])),
                     "profile_prefill_ms": 1000 * model.step_seconds(0, 0, int(prompt), prompt * prompt),
                     "measured_tpot_ms": float(np.median([lat["tpot"] for lat in latencies])),
                     "simulated_tpot_ms": None if alone is None else 1000 * alone.tpot,
                     "measured_first_itl_ms": median_or_none(first_itls_ms(run, done)),
                     "simulated_first_itl_ms": None if alone is None or alone.first_itl is None
                     else 1000 * alone.first_itl,
                     "measured_later_itl_ms": median_or_none(later_itls_ms(run, done)),
                     "profile_decode_step_ms": 1000 * model.step_seconds(1, int(prompt + output / 2), 0, 0.0)})
    return rows


def alone_on_layout(run: dict, model: StepModel, cluster: ClusterSpec, effects: HostEffects, prompt_len: int,
                    output_len: int) -> SimRequest:
    """One request of these lengths simulated alone on the run's layout (its `sweep` record)."""
    sweep = run["sweep"]
    spec = replace(cluster, num_prefill=int(sweep["num_prefill"]), num_decode=int(sweep["num_decode"]))
    request, = simulate(spec, model, [0.0], [prompt_len], [max(output_len, 1)], effects=effects)
    return request


def print_drift(rows: list[dict]) -> None:
    if rows:
        print("\nthe sweep's unloaded passes against the profile (the machine's drift between the two):")
    for row in rows:
        print(f"  {row['config']}: TTFT {_against(row['measured_ttft_ms'], row['profile_prefill_ms'], 'prefill step')}; "
              f"TPOT {_against(row['measured_tpot_ms'], row['simulated_tpot_ms'], 'simulated alone')}; first ITL "
              f"{_against(row['measured_first_itl_ms'], row['simulated_first_itl_ms'], 'simulated')}; later ITLs "
              f"{_against(row['measured_later_itl_ms'], row['profile_decode_step_ms'], 'decode step')}")


def _against(measured: float | None, predicted: float | None, what: str) -> str:
    if measured is None or not predicted:
        return "-"
    return f"{measured:.1f} ms measured, {what} {predicted:.1f} ms ({measured / predicted - 1:+.0%})"


def mae_with_measured(rows: list[dict]) -> dict[str, float]:
    """Per piece (error_pieces.py): the attainment MAE over the points with that piece measured."""
    result = {}
    for piece in PIECES:
        errors = [abs(r["slo_attainment_with_measured"][piece] - r["measured_slo_attainment"]) for r in rows
                  if piece in r["slo_attainment_with_measured"]]
        if errors:
            result[piece] = 100 * float(np.mean(errors))
    return result

