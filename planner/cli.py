"""`pdserve profile` and `pdserve plan`: flags -> profile, workload and cluster settings -> every xPyD split
simulated (or a sweep replayed with --validate) -> table, JSON and PNG (docs/benchmarking/plan.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from pdserve.planner.profile.fit import Profile, load_profile, model_identity
from pdserve.planner.profile.report import compute_line
from pdserve.planner.model.host_cpu import NO_HOST_CPU, HostCpu, plan_host_cpu
from pdserve.planner.model.host_effects import HostEffects, host_effects
from pdserve.planner.search.recommend import (PlanSettings, plan_adaptive, plan_splits, recommend, run_split,
                                              smallest_engines)
from pdserve.planner.search.goodput import search_adaptive, search_splits
from pdserve.planner.model.simulator import ClusterSpec, StepModel
from pdserve.planner.model.workload import Workload, workload_from_args
from pdserve.bench.serve_metrics import parse_slos

PLAN_COLUMNS = (("config", "config", "{}"), ("request_rate", "rate/s", "{:.3g}"), ("slo_attainment", "attain", "{:.0%}"),
                ("median_ttft_ms", "TTFT p50 ms", "{:.0f}"), ("p90_ttft_ms", "TTFT p90", "{:.0f}"),
                ("median_tpot_ms", "TPOT p50 ms", "{:.1f}"), ("p90_tpot_ms", "TPOT p90", "{:.1f}"),
                ("goodput", "goodput/s", "{:.3g}"), ("goodput_per_engine", "per engine", "{:.3g}"))


MAX_ENGINES = 1024  # the most engines one plan splits: 1,025 rows, each a simulation


def run_profile(args: argparse.Namespace) -> int:
    from pdserve.planner.profile.measure import run_profile as measure
    from pdserve.bench.serve import check_save_path

    check_save_path(args.out, "--out")  # before minutes of measuring
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: measure each shape at least once")

    return measure(args)


def cluster_spec(args: argparse.Namespace, profile: Profile) -> ClusterSpec:
    if args.local_prefill_threshold < 0:
        raise ValueError(f"--local-prefill-threshold {args.local_prefill_threshold}: give 0 or more tokens (0: every "
                         "prompt goes to a prefill engine), as the router takes it")
    return ClusterSpec(0, 1, profile.engine, profile.model.kv_bytes_per_token, args.prefill_policy, args.decode_policy,
                       args.local_prefill_threshold, args.kv_streaming == "on")


def step_model(profile: Profile, effects: HostEffects) -> StepModel:
    """The profile's step model, scaled as the host's effects say (--step-scale, --per-point-speed)."""
    return effects.scaled(StepModel.from_profile(profile))


def check_slos_reachable(settings: PlanSettings) -> None:
    """An SLO below what one request alone gets on the best split cannot be met at any rate."""
    workload = settings.workload
    order = sorted(range(len(workload)), key=lambda i: workload.prompt_lens[i] + workload.output_lens[i])
    median = order[len(order) // 2]
    alone = Workload([workload.prompt_lens[median]], [workload.output_lens[median]])
    best: dict[str, float] = {}
    for x, y in ((0, 1), (1, 1)):
        metrics = run_split(PlanSettings(settings.model, alone, {}, settings.cluster, effects=settings.effects), x, y,
                            1.0)
        for name in settings.slos_ms:
            value = metrics[f"median_{name}_ms"]
            best[name] = min(best.get(name, math.inf), value)
    for name, limit in settings.slos_ms.items():
        if limit < best[name]:
            raise ValueError(f"--slo {name}:{limit:g} is below the unloaded {name.upper()} of a median request "
                             f"({best[name]:.0f} ms on the best split, from the profile): no split meets it at any "
                             f"rate; raise it above {best[name]:.0f} ms")


def cpu_seconds() -> float:
    """This process's CPU time and that of its finished children (the goodput search's workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def format_table(rows: list[dict], columns=PLAN_COLUMNS) -> str:
    def cell(row: dict, key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    table = [[title for _, title, _ in columns]] + [[cell(row, key, fmt) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in table)


def check_nothing_validate_ignores(args: argparse.Namespace) -> None:
    """--validate replays the sweep's own layouts, rates and datasets: a flag that would choose them is refused, not
    silently dropped."""
    given = [flag for flag, value in (("--engines", args.engines), ("--request-rate", args.request_rate),
                                      ("--target-rate", args.target_rate), ("--find-goodput", args.find_goodput or None))
             if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} with --validate: the replay runs the sweep's own layouts and request "
                         "rates; drop them, or plan without --validate")


def run_plan(args: argparse.Namespace) -> int:
    from pdserve.bench.serve import check_output_dir, new_output_dir

    args.output_dir = str(args.output_dir or new_output_dir("plans"))
    check_output_dir(args.output_dir)  # before the simulations (a 100,000-request plan runs for a minute)
    profile = load_profile(args.profile)
    if args.model:
        profile.check_model(model_identity(args.model, profile.model.dtype), args.model)
    if args.validate:
        from pdserve.planner.validate.replay import run_validate

        check_nothing_validate_ignores(args)
        return run_validate(args, profile)
    if args.per_point_speed:
        raise ValueError("--per-point-speed reads a sweep's reference runs: it goes with --validate SWEEP_DIR")
    if args.host_cpu_from:
        raise ValueError("--host-cpu-from fits the host's CPU to a sweep for --validate; for a plan give "
                         "--host-cpu-per-token US and --host-background-cpu CORES")
    if args.engines is None or args.engines < 1:
        raise ValueError("pass --engines N (at least 1): the engines to split into prefill and decode")
    if args.engines > MAX_ENGINES:
        raise ValueError(f"--engines {args.engines}: plan splits at most {MAX_ENGINES} engines (every split is one "
                         "row); plan a group of identical engines behind one router and repeat the group")
    if args.exact_up_to < 0:
        raise ValueError(f"--exact-up-to {args.exact_up_to}: give 0 or more engines (0: always one engine per tier)")
    slos = parse_slos(args.slo, "--slo")
    if not slos:
        raise ValueError("pass --slo, e.g. --slo ttft:2000 tpot:150: a split is judged by its goodput under SLOs")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: give at least 1 process for the goodput search")
    if args.target_rate is not None and not (args.target_rate > 0 and math.isfinite(args.target_rate)):
        raise ValueError(f"--target-rate {args.target_rate:g}: give the requests per second the cluster must serve, "
                         f"a number above 0")
    started, started_cpu = time.perf_counter(), cpu_seconds()
    host = plan_host_cpu(args)
    effects = host_effects(args, profile, host)
    settings = PlanSettings(step_model(profile, effects), workload_from_args(args), slos, cluster_spec(args, profile),
                            args.burstiness, args.seed, args.exact_up_to, effects)
    check_slos_reachable(settings)
    if args.request_rate is None:
        rows = search_splits(settings, args.engines, args.jobs, show_progress=True)
    else:
        rows = plan_splits(settings, args.engines, args.request_rate)
    best = recommend(rows)
    adaptive = None
    if args.adaptive:
        adaptive = (search_adaptive(settings, args.engines, rows) if args.request_rate is None
                    else plan_adaptive(settings, args.engines, args.request_rate))
    smallest = smallest_engines(settings, args.target_rate, args.engines) if args.target_rate else None
    elapsed, cpu = time.perf_counter() - started, cpu_seconds() - started_cpu
    print(format_table(rows + ([adaptive] if adaptive else [])))
    print(f"\n{compute_line(profile)}")
    print(recommendation(best, args) + f"; {len(rows)} splits of {settings.workload.describe()} "
          f"simulated in {elapsed:.1f} s ({cpu:.1f} s of CPU)")
    if adaptive is not None:
        print(adaptive_line(adaptive, best, args.engines))
    if host is not NO_HOST_CPU:
        print(f"{host.describe()}: charged to the engines' steps while none is idle (one core per engine), in the "
              f"splits simulated whole (up to --exact-up-to {args.exact_up_to} engines)")
    if best is not None:
        print(f"serve it with:\n  {up_command(best, args, profile)}")
    if args.target_rate:
        print(f"smallest cluster for {args.target_rate:g} req/s: " + (
            f"{smallest['num_engines']} engines as {smallest['config']}" if smallest else
            f"none up to {args.engines} engines; give more --engines"))
    write_outputs(args, profile, rows, best, smallest, elapsed, cpu, host, adaptive)
    return 0


def adaptive_line(adaptive: dict, best: dict | None, num_engines: int) -> str:
    """The adaptive layout beside the best static split, as the simulator predicts them."""
    attained = "-" if adaptive["slo_attainment"] is None else f"{adaptive['slo_attainment']:.0%}"
    line = (f"adaptive ({num_engines} dual-role engines, each request's prefill and decode engine chosen at its "
            f"arrival): goodput {adaptive['goodput']:.3g} req/s (attainment {attained})")
    if best is None:
        return line + "; no static split has any goodput (predicted)"
    if math.isinf(best["goodput"]):
        return line + (f"; the best static split {best['config']} met the SLOs at every rate tried: its sample is too "
                       "small to bound it (raise --num-prompts, or --exact-up-to to simulate it whole) (predicted)")
    ratio = adaptive["goodput"] / best["goodput"]
    return line + f", {ratio:.2f}x the best static split {best['config']} ({best['goodput']:.3g} req/s) (predicted)"


def up_command(best: dict, args: argparse.Namespace, profile: Profile) -> str:
    """The `pdserve up` line of the recommended split, with the profiled engine's settings and the planned router's
    policies (the flags left at up's defaults left out)."""
    device = str(profile.machine.get("device", "cpu")).split(":")[0]
    words = ["pdserve", "up"] + (["--model", args.model] if args.model else [])
    words += ["--num-prefill", str(best["num_prefill"]), "--num-decode", str(best["num_decode"])]
    words += [] if device == "cpu" else ["--device", device]
    words += ["--dtype", profile.engine.dtype] if profile.engine.dtype else []  # unknown: up's own default
    if profile.engine.max_num_batched_tokens != 2048:
        words += ["--max-num-batched-tokens", str(profile.engine.max_num_batched_tokens)]
    for flag, value, default in (("--prefill-policy", args.prefill_policy, "prefix_aware"),
                                 ("--decode-policy", args.decode_policy, "least_kv"),
                                 ("--local-prefill-threshold", args.local_prefill_threshold, 0)):
        if value != default:
            words += [flag, str(value)]
    return shlex.join(words) + ("" if args.model else "   # the built-in demo model: add --model DIR for yours")


def recommendation(best: dict | None, args: argparse.Namespace) -> str:
    slos = " ".join(args.slo)
    if best is not None:
        return f"recommended: {best['config']} ({best['goodput_per_engine']:.3g} req/s per engine under {slos})"
    at = ("at any rate the search tried" if args.request_rate is None
          else f"at {args.request_rate:g} req/s; lower --request-rate, or leave it out to search each split's goodput")
    return f"recommended: none (no split meets {slos} {at}; or loosen --slo)"


def plot_title(args: argparse.Namespace) -> str:
    """The SLOs and the workload, for plan_goodput.png's title."""
    load = ("goodput: the highest rate with >= 90% of requests within the SLOs" if args.request_rate is None
            else f"at {args.request_rate:g} req/s")
    lengths = (f"{args.input_len} in / {args.output_len} out tokens" if args.dataset == "random"
               else f"dataset {args.dataset}")
    requests = (f"phases {args.phases} x {args.phase_cycles}" if args.dataset == "phased"
                else f"{args.num_prompts:,} requests, {lengths}")
    return f"{args.engines} engines; SLOs {' '.join(args.slo)} (ms); {requests}\n{load}"


def write_outputs(args, profile: Profile, rows: list[dict], best: dict, smallest: dict | None, elapsed: float,
                  cpu: float, host: HostCpu, adaptive: dict | None = None) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"profile": str(args.profile), "model": profile.model.model_dump(), "machine": profile.machine,
              "engines": args.engines, "slos_ms": parse_slos(args.slo, "--slo"), "request_rate": args.request_rate,
              "dataset": {k: getattr(args, k) for k in ("dataset", "dataset_path", "num_prompts", "input_len",
                                                         "output_len", "range_ratio", "burstiness", "seed",
                                                         "phases", "phase_cycles")},
              "step_scale": list(args.step_scale), "host_cpu": asdict(host), "splits": rows, "recommended": best, "adaptive": adaptive,
              "smallest": smallest,
              "seconds": elapsed, "cpu_seconds": cpu}
    (out / "plan.json").write_text(json.dumps(result, indent=1, default=str))
    from pdserve.planner.plots import can_plot, plot_goodput

    plotted = not args.no_plots and can_plot("plan_goodput.png")
    if plotted:
        plot_goodput(rows, out / "plan_goodput.png", best, plot_title(args))
    print(f"wrote {out / 'plan.json'}" + (f" and {out / 'plan_goodput.png'}" if plotted else ""))

