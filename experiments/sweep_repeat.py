"""`python experiments/sweep_repeat.py FIRST SECOND`: how well a machine repeats a sweep. Two `pdserve sweep`
directories of the same commands (same configs, rates, datasets and seeds), measured at different times: each
point's SLO attainment (both at the first sweep's SLOs, so only the measurement differs), p50 TTFT and TPOT, and
the mean differences. A planner validated on this machine cannot be held to a smaller error than these."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from pdserve.planner.cli import format_table
from pdserve.planner.validate.runs import load_runs, measured_metrics, read_runs, run_slos

COLUMNS = (("config", "config", "{}"), ("request_rate", "rate", "{:g}"),
           ("first_slo_attainment", "attain 1st", "{:.0%}"), ("second_slo_attainment", "2nd", "{:.0%}"),
           ("first_median_ttft_ms", "p50_ttft 1st", "{:.0f}"), ("second_median_ttft_ms", "2nd", "{:.0f}"),
           ("first_median_tpot_ms", "p50_tpot 1st", "{:.1f}"), ("second_median_tpot_ms", "2nd", "{:.1f}"))


def point_key(run: dict) -> tuple:
    return run["config"], float(run["request_rate"]), int(run.get("seed") or 0), len(run["input_lens"])


def paired_points(first_dir: Path, second_dir: Path) -> list[dict]:
    """One row per (config, rate, seed, requests) measured in both, at the first sweep's SLOs."""
    second = {point_key(run): run for run in read_runs(load_runs(second_dir), second_dir)}
    rows = []
    for run in read_runs(load_runs(first_dir), first_dir):
        other = second.get(point_key(run))
        if other is None:
            continue
        slos = run_slos(run)
        row = {"config": run["config"], "request_rate": float(run["request_rate"]), "slos_ms": slos}
        for side, measured in (("first", measured_metrics(run, slos)), ("second", measured_metrics(other, slos))):
            row.update({f"{side}_{key}": value for key, value in measured.items()})
        rows.append(row)
    if not rows:
        raise ValueError(f"{first_dir} and {second_dir} share no point (config, rate, seed, requests): pass two "
                         "sweeps of the same commands")
    return rows


def differences(rows: list[dict]) -> dict:
    """Mean |difference| of attainment (pp) and mean relative difference of p50 TTFT and TPOT (second / first)."""
    attainment = [abs(r["second_slo_attainment"] - r["first_slo_attainment"]) for r in rows
                  if r["first_slo_attainment"] is not None]
    summary = {"num_points": len(rows), "attainment_mean_abs_difference_pp":
               100 * float(np.mean(attainment)) if attainment else None}
    for key in ("median_ttft_ms", "median_tpot_ms"):
        changes = [r[f"second_{key}"] / r[f"first_{key}"] - 1 for r in rows if r[f"first_{key}"] and r[f"second_{key}"]]
        if changes:
            summary[f"{key}_mean_abs_change"] = float(np.mean(np.abs(changes)))
            summary[f"{key}_change_range"] = [float(min(changes)), float(max(changes))]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/sweep_repeat.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="a `pdserve sweep` output directory")
    parser.add_argument("second", type=Path, help="the same sweep measured again")
    parser.add_argument("--json", type=Path, help="also write the rows and the summary here")
    args = parser.parse_args(argv)
    try:
        rows = paired_points(args.first, args.second)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = differences(rows)
    print(format_table(rows, COLUMNS))
    mae = summary["attainment_mean_abs_difference_pp"]
    print(f"\n{summary['num_points']} points; attainment differs by {'-' if mae is None else f'{mae:.1f}'} pp on average")
    for key in ("median_ttft_ms", "median_tpot_ms"):
        if f"{key}_mean_abs_change" in summary:
            low, high = summary[f"{key}_change_range"]
            print(f"  {key}: mean |change| {summary[f'{key}_mean_abs_change']:.0%} ({low:+.0%} to {high:+.0%})")
    if args.json:
        args.json.write_text(json.dumps({"first": str(args.first), "second": str(args.second), "points": rows,
                                         "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
