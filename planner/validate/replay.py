"""`pdserve plan --validate SWEEP_DIR`: every run of a `pdserve sweep` directory replayed in the simulator
with its own lengths, rate, burstiness and seed, and the prediction set against what the run measured:
SLO attainment, p50/p90 TTFT and TPOT, and the p50 first ITL (the wait for the second token, where a 1P1D
request's KV transfer sits) per (config, rate), goodput per config, and the issue's goals. The sweep's unloaded
passes are set against the simulator's prediction for one request alone on their layout, and so are its reference
runs around each point (plan_speed.py), which --per-point-speed applies to the profile."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from pdserve.planner.cli import cluster_spec, format_table, step_model
from pdserve.planner.validate.error_pieces import PIECE_TITLES, PIECES, attainment_with_measured
from pdserve.planner.profile.fit import Profile, model_identity
from pdserve.planner.model.host_cpu import NO_HOST_CPU, HostCpu, given_host_cpu, validate_host_cpu
from pdserve.planner.model.metrics import predicted_metrics
from pdserve.planner.validate.prefill_check import prefill_busy_ratio
from pdserve.planner.search.recommend import PlanSettings, simulate_split
from pdserve.planner.validate.sampling import sampling_floor_pp
from pdserve.planner.model.simulator import ClusterSpec, SimRequest, StepModel, simulate
from pdserve.planner.validate.speed import ReferenceSpeed, reference_speeds, speed_around
from pdserve.planner.validate.step_check import step_ratio
from pdserve.planner.model.workload import Workload
from pdserve.bench.sweep_results import ATTAINMENT_TARGET, parse_slos, request_latencies_ms, slo_attainment
from pdserve.bench.sweep_unloaded import UNLOADED_PHASE

COMPARED = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")  # the goals
FIRST_ITL = "median_first_itl_ms"  # compared too, outside the goals: the KV's path to the second token
GOAL_ATTAINMENT_MAE_PP = 5.0
GOAL_P50_RELATIVE = 0.15
GOAL_GOODPUT_MARGIN = 0.10
REPLAYED_KEYS = ("config", "request_rate", "input_lens", "output_lens")  # what a replay reads from a run
COLUMNS = (("config", "config", "{}"), ("request_rate", "rate", "{:g}"),
           ("measured_slo_attainment", "attain meas", "{:.0%}"), ("predicted_slo_attainment", "pred", "{:.0%}"),
           *[(f"{side}_{key}", f"{key.replace('_ms', '').replace('median', 'p50')} {'meas' if side == 'measured' else 'pred'}",
              "{:.0f}" if "ttft" in key else "{:.1f}") for key in COMPARED for side in ("measured", "predicted")],
           *[(f"{side}_{FIRST_ITL}", f"p50_itl1 {'meas' if side == 'measured' else 'pred'}", "{:.0f}")
             for side in ("measured", "predicted")],
           ("measured_step_ratio", "step meas/prof", "{:.2f}"), ("prefill_busy_ratio", "busy P meas/sim", "{:.2f}"))
REFERENCE_COLUMNS = (("reference_speed_prefill", "ref P", "{:.2f}"), ("reference_speed_decode", "ref D", "{:.2f}"))


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


def read_unloaded(all_runs: list[dict]) -> list[dict]:
    """The sweep's unloaded passes (one request at a time per layout): how fast the machine was in the sweep's
    window, to hold against the profile's own figures."""
    return [run for run in all_runs if run.get("phase") == UNLOADED_PHASE and run.get("ttfts")]


def unloaded_drift(runs: list[dict], model: StepModel, cluster: ClusterSpec) -> list[dict]:
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
        alone = alone_on_layout(run, model, cluster, round(prompt), round(output)) if run.get("sweep") else None
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


def alone_on_layout(run: dict, model: StepModel, cluster: ClusterSpec, prompt_len: int, output_len: int) -> SimRequest:
    """One request of these lengths simulated alone on the run's layout (its `sweep` record)."""
    sweep = run["sweep"]
    spec = replace(cluster, num_prefill=int(sweep["num_prefill"]), num_decode=int(sweep["num_decode"]))
    request, = simulate(spec, model, [0.0], [prompt_len], [max(output_len, 1)])
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


def check_run_model(profile: Profile, run: dict) -> None:
    model_dir = Path(run.get("model_id") or "")
    if (model_dir / "config.json").is_file():
        profile.check_model(model_identity(model_dir), f"the sweep's model {model_dir}")


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


def replay(run: dict, profile: Profile, args: argparse.Namespace, slos_override: dict[str, float],
           references: Sequence[ReferenceSpeed] = (), host: HostCpu = NO_HOST_CPU) -> dict:
    """One run against its simulation, judged by slos_override or else by the SLOs the run was judged by; with
    --per-point-speed, the profile's steps scaled by the reference runs around it; the host's CPU per streamed token
    charged as `host` says."""
    sweep = run["sweep"]
    slos = slos_override or run_slos(run)
    workload = Workload([int(n) for n in run["input_lens"]], [int(n) for n in run["output_lens"]])
    speed = speed_around(run, references)
    scale = (1.0, 1.0)
    if args.per_point_speed:
        if speed is None:
            raise ValueError(f"--per-point-speed: {run['config']} at {float(run['request_rate']):g} req/s has no "
                             "reference run around it; run the sweep with --reference-requests K, or drop "
                             "--per-point-speed")
        scale = (speed.prefill, speed.decode or 1.0)
    settings = PlanSettings(step_model(args, profile, host, scale), workload, slos, cluster_spec(args, profile),
                            float(run.get("burstiness") or 1.0), int(run.get("seed") or 0), exact_up_to=1 << 30)
    requests = simulate_split(settings, int(sweep["num_prefill"]), int(sweep["num_decode"]), float(run["request_rate"]))
    predicted = predicted_metrics(requests, slos)
    measured = measured_metrics(run, slos)
    row = {"config": run["config"], "request_rate": float(run["request_rate"]), "slos_ms": slos,
           "num_requests": len(workload), "num_engines": int(sweep["num_engines"]),
           "num_prefill": int(sweep["num_prefill"])}
    for key in ("slo_attainment", *COMPARED, FIRST_ITL):
        row[f"measured_{key}"], row[f"predicted_{key}"] = measured[key], predicted[key]
    row["slo_attainment_with_measured"] = attainment_with_measured(run, requests, slos)
    row["measured_step_ratio"] = step_ratio(run, settings.model, int(sweep["num_decode"]))
    row["prefill_busy_ratio"] = prefill_busy_ratio(run, requests, int(sweep["num_prefill"]))
    row["reference_speed_prefill"] = speed.prefill if speed else None
    row["reference_speed_decode"] = speed.decode if speed else None
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
    summary["attainment_mae_pp_with_measured"] = mae_with_measured(with_slo)
    for key, name in (("measured_step_ratio", "step_ratio_range"), ("prefill_busy_ratio", "prefill_busy_ratio_range")):
        ratios = [r[key] for r in rows if r.get(key) is not None]
        summary[name] = [min(ratios), max(ratios)] if ratios else None
    for side in ("prefill", "decode"):
        speeds = [r[f"reference_speed_{side}"] for r in rows if r[f"reference_speed_{side}"] is not None]
        summary[f"reference_speed_{side}_range"] = [min(speeds), max(speeds)] if speeds else None
    summary["goodput"] = goodput_agreement(rows)
    return summary


def mae_with_measured(rows: list[dict]) -> dict[str, float]:
    """Per piece (plan_error_pieces.py): the attainment MAE over the points with that piece measured."""
    result = {}
    for piece in PIECES:
        errors = [abs(r["slo_attainment_with_measured"][piece] - r["measured_slo_attainment"]) for r in rows
                  if piece in r["slo_attainment_with_measured"]]
        if errors:
            result[piece] = 100 * float(np.mean(errors))
    return result


def goodput_agreement(rows: list[dict]) -> list[dict]:
    """Per sweep (same SLOs and engines): measured vs predicted goodput per config, and whether the split the
    planner would recommend (plan_recommend.recommend's rule) is the one measured best. A prediction of no
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
    models = {config: step_model(args, profile, host) for config, host in hosts.items()}
    cluster = cluster_spec(args, profile)
    references = [ref for config, model in models.items()
                  for ref in reference_speeds(of_config(all_runs, config), model, cluster)]
    rows = [replay(run, profile, args, slos_override, references, hosts[run["config"]]) for run in runs]
    summary = summarize_errors(rows)
    summary["per_point_speed"] = bool(args.per_point_speed)
    summary["host_cpu"] = {config: asdict(host) for config, host in hosts.items()}
    summary["unloaded"] = [row for config, model in models.items()
                           for row in unloaded_drift(read_unloaded(of_config(all_runs, config)), model, cluster)]
    print(format_table(rows, COLUMNS + (REFERENCE_COLUMNS if references else ())))
    print_summary(summary)
    for config, host in hosts.items():
        print(f"  {config}: {host.describe()}")
    print_drift(summary["unloaded"])
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps({"sweep_dir": str(sweep_dir), "profile": str(args.profile),
                                                     "slos_ms_override": slos_override or None,
                                                     "machine": profile.machine,
                                                     "step_scale": list(args.step_scale), "points": rows, "summary": summary},
                                                    indent=1))
    if not args.no_plots:
        from pdserve.planner.plots import plot_validation

        plot_validation(rows, out / "validation.png")
    print(f"wrote {out / 'validation.json'}" + ("" if args.no_plots else f" and {out / 'validation.png'}"))
    return 0


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


def print_summary(summary: dict) -> None:
    mae = summary["attainment_mae_pp"]
    print(f"\n{summary['num_points']} points; SLO attainment MAE "
          + ("-" if mae is None else f"{mae:.1f} pp (goal <= {GOAL_ATTAINMENT_MAE_PP:g})"))
    if summary["attainment_sampling_floor_pp"] is not None:
        print(f"  an exact simulator would still be {summary['attainment_sampling_floor_pp']:.1f} pp off on average: "
              "each point's attainment is a sample of its requests (binomial)")
    pieces = summary["attainment_mae_pp_with_measured"]
    if pieces:
        print("  attainment MAE with one piece of every request measured instead of predicted: "
              + ", ".join(f"{PIECE_TITLES[piece]} {mae:.1f} pp" for piece, mae in pieces.items()))
    for key in (*COMPARED, FIRST_ITL):
        if f"{key}_mean_relative_error" in summary:
            print(f"  {key}: mean |error| {summary[f'{key}_mean_relative_error']:.0%}, "
                  f"{summary[f'{key}_within_15pct']}/{summary['num_points']} within 15%")
    if summary["step_ratio_range"]:
        low, high = summary["step_ratio_range"]
        print(f"  decode steps under load against the profile's step for their batch (plan_step_check.py): "
              f"x{low:.2f} to x{high:.2f} (the machine's drift and the step model's error)")
    if summary.get("prefill_busy_ratio_range"):
        low, high = summary["prefill_busy_ratio_range"]
        print(f"  the prefill engine's busy time under load against the simulated (one prefill engine; "
              f"plan_prefill_check.py): x{low:.2f} to x{high:.2f} (the machine's drift and the prefill model's error)")
    if summary["reference_speed_prefill_range"]:
        ranges = {side: summary[f"reference_speed_{side}_range"] for side in ("prefill", "decode")}
        print("  the reference runs around each point against the profile (the machine's speed of the moment): "
              + ", ".join(f"{side} x{low:.2f} to x{high:.2f}" for side, (low, high) in
                          ((side, r) for side, r in ranges.items() if r))
              + ("; the steps were scaled by them (--per-point-speed)" if summary["per_point_speed"] else ""))
    for group in summary["goodput"]:
        print(f"  goodput measured {group['measured']} predicted {group['predicted']}: best "
              f"{group['measured_best'] or 'none'} vs {group['predicted_best'] or 'none'}"
              + ("" if group["decisive"] else " (measured goodputs within 10%: not decisive)"))

