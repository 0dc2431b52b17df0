"""`pdserve plan --validate SWEEP_DIR`: every run of a `pdserve sweep` directory replayed in the simulator with its
own lengths, rate, burstiness and seed, and the prediction set against what the run measured: SLO attainment,
p50/p90 TTFT and TPOT, and the p50 first ITL (the wait for the second token, where a 1P1D request's KV transfer
sits) per (config, rate), goodput per config, and the goals. --diagnose adds where the misses come from
(diagnose.py); --per-point-speed scales the profile at each point by the sweep's reference runs (speed.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pdserve.bench.serve_metrics import parse_slos
from pdserve.bench.sweep_results import ATTAINMENT_TARGET
from pdserve.planner.cli import cluster_spec, format_table, step_model
from pdserve.planner.model.host_cpu import HostCpu, given_host_cpu, validate_host_cpu
from pdserve.planner.model.host_effects import HostEffects, host_effects
from pdserve.planner.model.metrics import predicted_metrics
from pdserve.planner.model.workload import Workload
from pdserve.planner.profile.fit import Profile
from pdserve.planner.profile.report import compute_line
from pdserve.planner.search.recommend import PlanSettings, simulate_split
from pdserve.planner.validate import diagnose
from pdserve.planner.validate.runs import (FIRST_ITL, check_run_model, load_runs, measured_metrics, of_config,
                                           read_runs, run_slos)
from pdserve.planner.validate.sampling import sampling_floor_pp
from pdserve.planner.validate.speed import ReferenceSpeed, reference_speeds, speed_around

COMPARED = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")  # the goals
GOAL_ATTAINMENT_MAE_PP = 5.0
GOAL_P50_RELATIVE = 0.15
GOAL_GOODPUT_MARGIN = 0.10
PLAIN = {"median_ttft_ms": "TTFT p50", "p90_ttft_ms": "TTFT p90", "median_tpot_ms": "TPOT p50",
         "p90_tpot_ms": "TPOT p90", FIRST_ITL: "2nd token"}


def side_columns(key: str, title: str, fmt: str) -> list[tuple[str, str, str]]:
    return [(f"{side}_{key}", f"{title} {'meas' if side == 'measured' else 'pred'}", fmt)
            for side in ("measured", "predicted")]


COLUMNS = (("config", "split", "{}"), ("request_rate", "req/s", "{:g}"),
           *side_columns("slo_attainment", "met", "{:.0%}"),
           *[column for key in ("median_ttft_ms", "median_tpot_ms", FIRST_ITL)
             for column in side_columns(key, PLAIN[key], "{:.1f}" if "tpot" in key else "{:.0f}")])
P90_COLUMNS = tuple(column for key in ("p90_ttft_ms", "p90_tpot_ms")
                    for column in side_columns(key, PLAIN[key], "{:.1f}" if "tpot" in key else "{:.0f}"))
LEGEND = ("split: xPyD, x prefill and y decode engines (0PyD: each engine prefills its own); req/s: the sweep's "
          "request rate",
          "meas: what the sweep measured; pred: what the plan predicts from the profile",
          "met: the share of requests that met every SLO",
          "TTFT p50: median time to the first token (ms); TPOT p50: median time per output token after the first (ms)",
          "2nd token: median wait for the second token (ms), where a disaggregated request's KV transfer sits")


def replay(run: dict, profile: Profile, args: argparse.Namespace, slos_override: dict[str, float],
           effects: HostEffects, references: Sequence[ReferenceSpeed] = ()) -> dict:
    """One run against its simulation, judged by slos_override or else by the SLOs the run was judged by, with the
    host's effects; with --per-point-speed, the profile's steps scaled by the reference runs around it."""
    sweep = run["sweep"]
    slos = slos_override or run_slos(run)
    workload = Workload([int(n) for n in run["input_lens"]], [int(n) for n in run["output_lens"]])
    speed = speed_around(run, references)
    if args.per_point_speed:
        if speed is None:
            raise ValueError(f"--per-point-speed: {run['config']} at {float(run['request_rate']):g} req/s has no "
                             "reference run around it; run the sweep with --reference-requests K, or drop "
                             "--per-point-speed")
        effects = effects.with_speed((speed.prefill, speed.decode or 1.0))
    settings = PlanSettings(step_model(profile, effects), workload, slos, cluster_spec(args, profile),
                            float(run.get("burstiness") or 1.0), int(run.get("seed") or 0), exact_up_to=1 << 30,
                            effects=effects)
    requests, _ = simulate_split(settings, int(sweep["num_prefill"]), int(sweep["num_decode"]), float(run["request_rate"]))
    predicted = predicted_metrics(requests, slos)
    measured = measured_metrics(run, slos)
    row = {"config": run["config"], "request_rate": float(run["request_rate"]), "slos_ms": slos,
           "num_requests": len(workload), "num_engines": int(sweep["num_engines"]),
           "num_prefill": int(sweep["num_prefill"])}
    for key in ("slo_attainment", *COMPARED, FIRST_ITL):
        row[f"measured_{key}"], row[f"predicted_{key}"] = measured[key], predicted[key]
    if args.diagnose:
        row.update(diagnose.point_diagnostics(run, requests, settings, speed))
    return row


def goodput_of(rows: list[dict], config: str, side: str) -> float:
    """The highest listed rate whose attainment is >= 90% (0 when none), as a sweep's goodput.csv."""
    return max((r["request_rate"] for r in rows if r["config"] == config
                and (r[f"{side}_slo_attainment"] or 0) >= ATTAINMENT_TARGET), default=0.0)


def summarize_errors(rows: list[dict]) -> dict:
    with_slo = [r for r in rows if r["measured_slo_attainment"] is not None]
    mae = 100 * float(np.mean([abs(r["predicted_slo_attainment"] - r["measured_slo_attainment"]) for r in with_slo])) \
        if with_slo else None
    relative = {key: [abs(r[f"predicted_{key}"] / r[f"measured_{key}"] - 1) for r in rows
                      if r[f"measured_{key}"] and r[f"predicted_{key}"]]
                for key in (*COMPARED, FIRST_ITL)}
    summary = {"num_points": len(rows), "attainment_mae_pp": mae,
               "attainment_sampling_floor_pp": sampling_floor_pp(rows),
               **{f"{key}_mean_relative_error": float(np.mean(v)) for key, v in relative.items() if v},
               **{f"{key}_within_15pct": sum(e <= GOAL_P50_RELATIVE for e in v) for key, v in relative.items() if v}}
    summary["goodput"] = goodput_agreement(rows)
    return summary


def goodput_agreement(rows: list[dict]) -> list[dict]:
    """Per sweep (same SLOs and engines): measured vs predicted goodput per config, and whether the split the
    planner would recommend (recommend.recommend's rule) is the one measured best. A prediction of no
    goodput anywhere recommends nothing, so it agrees with no decisive sweep."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((json.dumps(row["slos_ms"], sort_keys=True), row["num_engines"]), []).append(row)
    result = []
    for (slos, engines), group in groups.items():
        num_prefill = {r["config"]: r["num_prefill"] for r in group}
        measured = {c: goodput_of(group, c, "measured") for c in sorted(num_prefill)}
        predicted = {c: goodput_of(group, c, "predicted") for c in sorted(num_prefill)}
        best_measured, best_predicted = best_split(measured, num_prefill), best_split(predicted, num_prefill)
        top, second = sorted(measured.values(), reverse=True)[:2] if len(measured) > 1 else (1.0, 0.0)
        decisive = top > 0 and (top - second) > GOAL_GOODPUT_MARGIN * top
        result.append({"slos_ms": json.loads(slos), "num_engines": engines, "measured": measured,
                       "predicted": predicted, "measured_best": best_measured, "predicted_best": best_predicted,
                       "decisive": decisive, "agrees": best_measured == best_predicted or not decisive})
    return result


def best_split(goodputs: dict[str, float], num_prefill: dict[str, int]) -> str | None:
    """The config with the best goodput, fewer prefill engines on a tie, as `pdserve plan` recommends (every
    config of a group has the same engines); None when no config has any goodput."""
    if not any(goodputs.values()):
        return None
    return max(goodputs, key=lambda config: (goodputs[config], -num_prefill[config]))


def run_validate(args: argparse.Namespace, profile: Profile) -> int:
    sweep_dir = Path(args.validate)
    all_runs = load_runs(sweep_dir)
    runs = read_runs(all_runs, sweep_dir)
    for run in runs:
        check_run_model(profile, run)
    slos_override = parse_slos(args.slo, "--slo")
    if args.per_point_speed and tuple(args.step_scale) != (1.0, 1.0):
        raise ValueError("--per-point-speed and --step-scale both scale the profile: give one of them")
    hosts = host_cpu_of(args, profile, all_runs, sweep_dir)
    effects = {config: host_effects(args, profile, host) for config, host in hosts.items()}
    models = {config: step_model(profile, config_effects) for config, config_effects in effects.items()}
    cluster = cluster_spec(args, profile)
    references = [ref for config, model in models.items()
                  for ref in reference_speeds(of_config(all_runs, config), model, cluster, effects[config])]
    rows = [replay(run, profile, args, slos_override, effects[run["config"]], references) for run in runs]
    summary = summarize_errors(rows)
    summary["per_point_speed"] = bool(args.per_point_speed)
    summary["host_cpu"] = {config: asdict(host) for config, host in hosts.items()}
    columns = COLUMNS
    if args.diagnose:  # the p90s and the diagnostics (planner/validate/diagnose.py prints their legend)
        unloaded = [row for config, model in models.items() for row in diagnose.unloaded_drift(
            diagnose.read_unloaded(of_config(all_runs, config)), model, cluster, effects[config])]
        summary.update(diagnose.summarize(rows, unloaded))
        columns += P90_COLUMNS + diagnose.COLUMNS + (diagnose.REFERENCE_COLUMNS if references else ())
    print(format_table(rows, columns))
    print("\n".join(["", compute_line(profile), *LEGEND]))
    print_summary(summary, hosts)
    if args.diagnose:
        diagnose.print_diagnostics(summary, args.per_point_speed)
    write_validation(args, profile, sweep_dir, slos_override, rows, summary)
    return 0


def write_validation(args: argparse.Namespace, profile: Profile, sweep_dir: Path, slos_override: dict[str, float],
                     rows: list[dict], summary: dict) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps({"sweep_dir": str(sweep_dir), "profile": str(args.profile),
                                                     "slos_ms_override": slos_override or None,
                                                     "machine": profile.machine, "step_scale": list(args.step_scale),
                                                     "points": rows, "summary": summary}, indent=1))
    from pdserve.planner.plots import can_plot, plot_validation

    plotted = not args.no_plots and can_plot("validation.png")
    if plotted:
        plot_validation(rows, out / "validation.png")
    print(f"wrote {out / 'validation.json'}" + (f" and {out / 'validation.png'}" if plotted else ""))


def host_cpu_of(args: argparse.Namespace, profile: Profile, all_runs: list[dict], sweep_dir: Path
                ) -> dict[str, HostCpu]:
    """The host's CPU figures per config of the sweep: fitted to its own runs, or to --host-cpu-from's."""
    configs = sorted({run["config"] for run in all_runs if run.get("config")})
    if args.host_cpu_from:
        if given_host_cpu(args) is not None:
            raise ValueError("--host-cpu-from fits the host's figures that --host-cpu-per-token and "
                             "--host-background-cpu give: pass one or the other")
        return validate_host_cpu(args, profile, configs, load_runs(Path(args.host_cpu_from)), args.host_cpu_from)
    return validate_host_cpu(args, profile, configs, all_runs, str(sweep_dir))


def print_summary(summary: dict, hosts: dict[str, HostCpu]) -> None:
    mae = summary["attainment_mae_pp"]
    print(f"\n{summary['num_points']} points; the predicted share of requests meeting the SLOs is off by "
          + ("-" if mae is None else f"{mae:.1f} percentage points on average (SLO attainment MAE; goal <= "
                                     f"{GOAL_ATTAINMENT_MAE_PP:g})"))
    if summary["attainment_sampling_floor_pp"] is not None:
        print(f"  an exact simulator would still be {summary['attainment_sampling_floor_pp']:.1f} pp off on average: "
              "each point's attainment is a sample of its requests (binomial)")
    for key in (*COMPARED, FIRST_ITL):
        if f"{key}_mean_relative_error" in summary:
            print(f"  {PLAIN[key]}: predicted {summary[f'{key}_mean_relative_error']:.0%} off on average, "
                  f"{summary[f'{key}_within_15pct']}/{summary['num_points']} within 15%")
    for group in summary["goodput"]:
        print(f"  goodput (req/s) measured {goodputs_text(group['measured'])}, predicted "
              f"{goodputs_text(group['predicted'])}: best measured {group['measured_best'] or 'none'}, predicted "
              f"{group['predicted_best'] or 'none'}"
              + ("" if group["decisive"] else " (measured goodputs within 10%: not decisive)"))
    for config, host in hosts.items():
        print(f"  {config}: {host.describe()}")


def goodputs_text(goodputs: dict[str, float]) -> str:
    """{'0P2D': 6.0, '1P1D': 5.5} -> '0P2D 6, 1P1D 5.5'."""
    return ", ".join(f"{config} {value:.3g}" for config, value in goodputs.items())
