"""`pdserve sweep`: `pdserve bench` across xPyD layouts of `pdserve up` (and external servers) at each load,
with the router's /metrics around every run, an optional goodput search per layout, and one output
directory: runs/*.json, summary.csv, goodput.csv, PNGs (docs/benchmarking/bench.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shlex
import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.bench.serve import new_output_dir
from pdserve.bench.serve_arrivals import check_arrival_span
from pdserve.bench.serve_metrics import parse_slos
from pdserve.bench.sweep_args import DATASET_FLAGS, resolve_num_prompts
from pdserve.bench.sweep_cluster import Cluster, ClusterError, ClusterSpec, engines_dtype
from pdserve.bench.sweep_goodput import find_goodput
from pdserve.bench.sweep_layouts import (
    ExternalServer,
    Layout,
    device_plan,
    parse_devices,
    parse_external,
    parse_layouts,
)
from pdserve.bench.sweep_results import (
    GOODPUT_COLUMNS,
    REFERENCE_PHASE,
    SUMMARY_COLUMNS,
    RunInfo,
    goodput_from_rows,
    slo_attainment,
    summary_row,
    write_csv,
)
from pdserve.bench.sweep_runs import BenchOptions, format_rate, run_bench, warm_up
from pdserve.bench.sweep_unloaded import UNLOADED_PHASE, goodput_flags, parse_slo_factors, slos_from_unloaded
from pdserve.progress import Progress

# flags the sweep gives `pdserve up` and `pdserve bench` for each layout and run
SET_FOR_UP = ("--model", "--num-prefill", "--num-decode", "--prefill", "--decode", "--port", "--log-dir", "--device",
              "--pin-cpus", "--no-pin-cpus", "--prefill-devices", "--decode-devices", "--api-key")
SET_FOR_BENCH = ("--base-url", "--model", "--num-prompts", "--request-rate", "--max-concurrency", "--seed",
                 "--save-result", "--metadata", "--goodput", "--api-key", *DATASET_FLAGS)


UNLOADED_SEED_INDEX = 10_000  # the unloaded runs' prompts: seed + this, apart from every load's
WARMUP_SEED_INDEX = 20_000  # the shaped warm-up runs' prompts, apart from every measured run's
REFERENCE_SEED_INDEX = 30_000  # the n-th reference run's prompts: seed + this + n
WARMUP_PHASE = "warmup"
NOT_LOADS = (UNLOADED_PHASE, REFERENCE_PHASE)  # one request at a time: rows kept out of the plots


class SearchStopped(Exception):
    """A goodput probe whose bench run failed (not a run that missed the SLOs)."""


@dataclass(frozen=True)
class SweepPlan:
    layouts: list[Layout]
    externals: list[ExternalServer]
    loads: list[tuple[float, int | None]]  # (request rate, max concurrency)
    slos: dict[str, float]
    cluster: ClusterSpec
    bench: BenchOptions
    output_dir: Path
    warmup: int = 4
    find_goodput: bool = False
    goodput_start_rate: float = 1.0
    goodput_steps: int = 4
    plots: bool = True
    slo_factors: dict[str, float] = field(default_factory=dict)  # with these, SLOs come from an unloaded pass
    unloaded_prompts: int = 4
    reference_requests: int = 0  # per reference run, before each load and after a server's last (0: none)
    reference_output_len: int = 32


def build_plan(args: argparse.Namespace) -> SweepPlan:
    """Every check before any process starts: a mistake costs nothing yet."""
    layouts = parse_layouts(args.configs)
    externals = [parse_external(text) for text in args.base_url]
    if not layouts and not externals:
        raise ValueError("nothing to benchmark: list --configs (e.g. 1P1D 0P2D) or --base-url NAME=URL")
    slos = parse_slos(args.goodput)
    slo_factors = parse_slo_factors(args.slo_factors)
    if slos and slo_factors:
        raise ValueError("--goodput and --slo-factors both set the SLOs: give one of them")
    if slo_factors and args.unloaded_prompts < 1:
        raise ValueError(f"--unloaded-prompts {args.unloaded_prompts}: give 1 or more")
    if args.reference_requests < 0 or args.reference_output_len < 1:
        raise ValueError(f"--reference-requests {args.reference_requests} --reference-output-len "
                         f"{args.reference_output_len}: give 0 or more requests (0 = no reference runs) of 1 or "
                         "more tokens")
    _check_loads(args, bool(slos or slo_factors))
    if not args.no_plots:
        from pdserve.bench.sweep_plots import pyplot

        pyplot()
    from pdserve.router_cli import resolve_model

    model, _ = resolve_model(args.model)
    devices = parse_devices(args.devices)
    if args.device.startswith("cuda"):
        for layout in layouts:
            device_plan(layout, devices)  # enough GPUs for every layout, or say so now
    up_args = _passed_through(args.up_args, "--up-args", SET_FOR_UP)
    bench_args = _passed_through(args.bench_args, "--bench-args", SET_FOR_BENCH)
    cluster = ClusterSpec(model, args.device, args.pin_cpus, args.cores_per_engine, devices, up_args, args.api_key,
                          args.startup_timeout, engines_dtype(model, up_args, args.device) if layouts else None)
    dataset_args = [item for flag in DATASET_FLAGS if getattr(args, _dest(flag)) is not None
                    for item in (flag, str(getattr(args, _dest(flag))))]
    bench = BenchOptions(model, args.num_prompts, args.seed, dataset_args, list(args.goodput or []), args.ignore_eos,
                         args.api_key, bench_args, args.metrics_interval, args.run_timeout)
    _check_bench_command(bench)
    loads = []  # none: --find-goodput alone
    if args.request_rates or args.max_concurrencies:
        loads = list(itertools.product(args.request_rates or [math.inf], args.max_concurrencies or [None]))
    output_dir = Path(args.output_dir) if args.output_dir else new_output_dir("sweeps")
    return SweepPlan(layouts, externals, loads, slos, cluster, bench, output_dir, args.warmup, args.find_goodput,
                     args.goodput_start_rate, args.goodput_steps, not args.no_plots, slo_factors,
                     args.unloaded_prompts, args.reference_requests, args.reference_output_len)


def _passed_through(text: str, option: str, reserved: tuple[str, ...]) -> list[str]:
    """--up-args / --bench-args split like a shell would, refusing the flags the sweep sets itself."""
    try:
        items = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{option} {text!r}: {exc}; quote it as one shell string") from exc
    taken = sorted({item.split("=", 1)[0] for item in items if item.split("=", 1)[0] in reserved})
    if taken:
        raise ValueError(f"{option} sets {', '.join(taken)}, which the sweep sets for each run: use the sweep's own "
                         f"options (`pdserve sweep --help`)")
    return items


def _check_bench_command(bench: BenchOptions) -> None:
    """The flags every run gives `pdserve bench`, checked as bench checks them: a flag bench does not take or a
    value it refuses is found now, not after a layout has started and each of its runs failed."""
    from pdserve.bench.serve import add_bench_args, check_args
    from pdserve.bench.sweep_runs import BENCH_COMMAND, bench_command

    parser = argparse.ArgumentParser(prog="pdserve bench", add_help=False, exit_on_error=False)
    add_bench_args(parser)
    info = RunInfo("1P1D", 2, "sweep", math.inf, None)
    command = bench_command(bench, "http://127.0.0.1:8000", info, Path("run.json"))[len(BENCH_COMMAND):]
    try:
        args, unknown = parser.parse_known_args(command)
    except argparse.ArgumentError as exc:
        raise ValueError(f"pdserve bench would refuse what the sweep passes it: {exc}: fix that flag") from None
    if unknown:
        raise ValueError(f"--bench-args: pdserve bench takes no {' '.join(unknown)} (`pdserve bench --help` lists "
                         "what it takes)")
    check_args(args)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _check_loads(args: argparse.Namespace, has_slos: bool) -> None:
    if not args.request_rates and not args.max_concurrencies and not args.find_goodput:
        raise ValueError("no load given: pass --request-rates (e.g. 1 2 4), --max-concurrencies, or --find-goodput")
    if any(not rate > 0 for rate in args.request_rates or []):
        raise ValueError(f"--request-rates {args.request_rates}: every rate must be > 0 (inf = all at once)")
    if any(c < 1 for c in args.max_concurrencies or []):
        raise ValueError(f"--max-concurrencies {args.max_concurrencies}: every cap must be >= 1")
    if args.warmup < 0 or args.goodput_steps < 0 or not args.goodput_start_rate > 0:
        raise ValueError(f"--warmup {args.warmup}, --goodput-steps {args.goodput_steps}, --goodput-start-rate "
                         f"{args.goodput_start_rate:g}: give counts >= 0 and a start rate > 0")
    resolve_num_prompts(args)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts {args.num_prompts}: give 1 or more")
    for rate in args.request_rates or []:  # a phased or trace run (no count) takes no finite rate
        check_arrival_span(args.num_prompts or 1, rate)  # bench would refuse each run, after its layout had started
    if args.find_goodput and not has_slos:
        raise ValueError("--find-goodput needs SLOs: add --goodput ttft:MS tpot:MS, or --slo-factors ttft:4 tpot:1.5")
    if args.devices and not args.device.startswith("cuda"):
        raise ValueError("--devices picks GPUs: add --device cuda")
    _check_seconds(args)


def _check_seconds(args: argparse.Namespace) -> None:
    for flag, seconds in (("--startup-timeout", args.startup_timeout), ("--run-timeout", args.run_timeout),
                          ("--metrics-interval", args.metrics_interval)):
        if seconds is not None and not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"{flag} {seconds:g}: give a number of seconds above 0")


class Sweep:
    """Runs a plan server by server, writing summary.csv and goodput.csv after each."""

    def __init__(self, plan: SweepPlan) -> None:
        self.plan = plan
        self.rows: list[dict] = []
        self.goodputs: list[dict] = []
        self.client_cores: list[int] | None = None  # the running layout's spare cores, for bench
        self.runs_dir = plan.output_dir / "runs"
        self.order = itertools.count()  # each run's place among its server's runs (references between loads)
        self.references_run = 0  # the running server's reference runs so far
        self.progress: Progress | None = None

    def run(self) -> None:
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        servers = len(self.plan.layouts) + len(self.plan.externals)
        unloaded = [0.0] * self.points_per_server(self.run_unloaded) if self.plan.slo_factors else []
        floors = servers * unloaded + servers * self.server_floors()
        with Progress(len(floors), "[pdserve sweep]", file=sys.stdout, unit="run", floors=floors) as self.progress:
            if self.plan.slo_factors:
                self.each_server(self.run_unloaded)
                self.derive_slos()
            self.each_server(self.run_server)

    def points_per_server(self, work) -> int:
        """The bench runs `work` makes on one server, a goodput search's probes not counted (added as they come)."""
        if work == self.run_unloaded:
            return (1 if self.plan.warmup else 0) + 1
        return len(self.server_floors())

    def server_floors(self) -> list[float]:
        """The seconds each of run_server's runs takes at least, in order: a load at a finite rate spans its
        arrivals (num_prompts / rate); warm-ups, references and loads sent at once are not known before they run."""
        warm = [0.0] if self.plan.warmup else []
        reference = [0.0] if self.plan.reference_requests else []
        prompts = self.plan.bench.num_prompts
        spans = [prompts / rate if prompts and math.isfinite(rate) and rate > 0 else 0.0 for rate, _ in self.plan.loads]
        return warm + [floor for span in spans for floor in (*reference, span)] + reference

    def bench_point(self, label: str, *args, **kwargs) -> tuple[dict, dict | None]:
        """run_bench(*args, **kwargs) as one point of the progress, with its line of results."""
        self.progress.start(label)
        row, result = run_bench(*args, **kwargs)
        self.progress.finish()
        self.progress.note(f"[pdserve sweep] {label}: {point_result(row)}")
        return row, result

    def each_server(self, work) -> None:
        """work(url, RunInfo, client cores) on each layout, started for it and stopped after, then on each
        external server."""
        for layout in self.plan.layouts:
            info = RunInfo(layout.name, layout.num_engines, "sweep", math.nan, None, layout.num_prefill,
                           layout.num_decode, self.plan.cluster.dtype)
            try:
                with Cluster(self.cluster_spec(layout), layout, self.plan.output_dir / "logs" / layout.name) as cluster:
                    work(cluster.url, info, cluster.client_cores)
            except ClusterError as exc:
                print(f"[pdserve sweep] error: {exc}", file=sys.stderr, flush=True)
                self.progress.add(-self.points_per_server(work))  # the layout never started: none of its runs
                self.rows.append(summary_row(replace(info, phase="start"), None, {}, self.plan.slos, "",
                                             str(exc).splitlines()[0]))
            self.write_tables()
        for external in self.plan.externals:
            work(external.url, RunInfo(external.name, external.num_engines, "sweep", math.nan, None))
            self.write_tables()

    def cluster_spec(self, layout: Layout) -> ClusterSpec:
        """The sweep's `pdserve up` settings; an adaptive layout's router also routes for the sweep's TTFT and TPOT
        SLOs once they are known (given, or derived from the unloaded runs)."""
        slos = {metric: ms for metric, ms in self.plan.slos.items() if metric in ("ttft", "tpot")}
        if not layout.num_dual or not slos:
            return self.plan.cluster
        flags = ["--slo", *(f"{metric}:{ms:g}" for metric, ms in slos.items())]
        return replace(self.plan.cluster, up_args=[*self.plan.cluster.up_args, *flags])

    def run_unloaded(self, url: str, base: RunInfo, client_cores: list[int] | None = None) -> None:
        """A few requests one at a time (their own prompts: seeds past every load's), for the SLOs' base."""
        self.warm_up_server(url, base, client_cores, before=UNLOADED_PHASE)
        options = replace(self.plan.bench, num_prompts=self.plan.unloaded_prompts)
        info = replace(base, phase=UNLOADED_PHASE, request_rate=math.inf, max_concurrency=1)
        label = f"{base.config} unloaded: {options.num_prompts} requests one at a time, for the SLOs"
        row, _ = self.bench_point(label, options, url, info, self.runs_dir, {}, UNLOADED_SEED_INDEX, client_cores)
        self.rows.append(row)

    def warm_up_server(self, url: str, base: RunInfo, client_cores: list[int] | None, before: str) -> None:
        """Before a freshly started server's first measured run: --warmup short requests at once, then one
        request per engine shaped like the runs' own (an unmeasured bench run, outside every run's /metrics
        window, saved as warmup/<config>_rateinf_warmup_<phase of the run it precedes>.json). The short ones
        leave each engine's first long prompt cold (its first prompts of that shape run slower), and an unloaded
        median sets the SLOs."""
        warm_up(self.plan.bench, url, self.plan.warmup)
        if not self.plan.warmup:
            return
        options = replace(self.plan.bench, num_prompts=max(1, base.num_engines), goodput=[])
        label = f"{base.config} warm-up: {options.num_prompts} unmeasured request(s) shaped like the runs"
        info = replace(base, phase=f"{WARMUP_PHASE}_{before}", request_rate=math.inf, max_concurrency=None)
        row, _ = self.bench_point(label, options, url, info, self.plan.output_dir / "warmup", {}, WARMUP_SEED_INDEX,
                                  client_cores)
        if row["error"]:
            print(f"[pdserve sweep] {base.config}: the shaped warm-up failed, measuring anyway: {row['error']}",
                  file=sys.stderr, flush=True)

    def derive_slos(self) -> None:
        """SLOs from the unloaded runs: into the plan (and bench's --goodput), slos.json, and the unloaded rows."""
        slos, basis = slos_from_unloaded(self.rows, self.plan.slo_factors)
        self.plan = replace(self.plan, slos=slos, bench=replace(self.plan.bench, goodput=goodput_flags(slos)))
        (self.plan.output_dir / "slos.json").write_text(json.dumps(basis, indent=2) + "\n")
        for metric, how in basis.items():
            self.progress.note(f"[pdserve sweep] {metric.upper()} SLO {how['slo_ms']:g} ms = {how['factor']:g} x "
                               f"{how['unloaded_median_ms']:.1f} ms ({how['from_config']}'s unloaded median)")
        for row in self.rows:
            if row.get("phase") == UNLOADED_PHASE and row.get("result_file"):
                result = json.loads(Path(row["result_file"]).read_text())
                row["slo_attainment"] = slo_attainment(result, slos)

    def run_server(self, url: str, base: RunInfo, client_cores: list[int] | None = None) -> None:
        self.client_cores = client_cores
        self.order, self.references_run = itertools.count(), 0
        self.warm_up_server(url, base, client_cores, before=base.phase)
        for index, (rate, concurrency) in enumerate(self.plan.loads):
            self.run_one(url, replace(base, request_rate=rate, max_concurrency=concurrency), index)
        if self.plan.find_goodput:
            self.search_goodput(url, base)
        elif self.plan.slos:
            self.goodput_from_loads(base)
        self.run_reference(url, base)  # after the last load: every load has a reference on each side

    def run_one(self, url: str, info: RunInfo, run_index: int) -> dict:
        self.run_reference(url, info)
        label = f"{info.config} at {load_text(info)}"
        if info.phase == "search":
            label = f"{info.config} goodput search at {load_text(info)}"
        row, _ = self.bench_point(label, self.plan.bench, url, info, self.runs_dir, self.plan.slos, run_index,
                                  self.client_cores, order=next(self.order))
        self.rows.append(row)
        return row

    def run_reference(self, url: str, base: RunInfo) -> None:
        """--reference-requests requests one at a time, --reference-output-len tokens each (prompts of their own):
        how fast the machine is just before a load (and after the last), which `plan --validate` can read around
        each point. Saved as runs/<config>_reference<n>.json, n counting the server's reference runs."""
        if not self.plan.reference_requests:
            return
        number = self.references_run
        self.references_run += 1
        options = replace(self.plan.bench, num_prompts=self.plan.reference_requests, goodput=[],
                          dataset_args=with_output_len(self.plan.bench.dataset_args, self.plan.reference_output_len))
        info = replace(base, phase=REFERENCE_PHASE, request_rate=math.inf, max_concurrency=1)
        label = f"{base.config} reference run {number}: {options.num_prompts} requests one at a time"
        row, _ = self.bench_point(label, options, url, info, self.runs_dir, {}, REFERENCE_SEED_INDEX + number,
                                  self.client_cores, name=f"{base.config}_reference{number}", order=next(self.order))
        self.rows.append(row)

    def search_goodput(self, url: str, base: RunInfo) -> None:
        """Probes at rates of its choosing (no concurrency cap), seeded from this server's listed rates."""
        known = {row["request_rate"]: row["slo_attainment"] for row in self.rows
                 if row["config"] == base.config and row.get("max_concurrency") is None
                 and row.get("slo_attainment") is not None and math.isfinite(row["request_rate"])}
        probe_indexes = itertools.count(len(self.plan.loads))

        def attainment_at(rate: float) -> float:
            self.progress.add(2 if self.plan.reference_requests else 1)  # the probe (and its reference run)
            row = self.run_one(url, replace(base, phase="search", request_rate=rate), next(probe_indexes))
            if row["slo_attainment"] is None:  # bench itself failed: no rate will do better
                raise SearchStopped(row["error"])
            return row["slo_attainment"]

        try:
            search = find_goodput(attainment_at, self.plan.goodput_start_rate, known, self.plan.goodput_steps)
        except SearchStopped as exc:
            print(f"[pdserve sweep] {base.config}: goodput search stopped: a run failed ({exc})", file=sys.stderr,
                  flush=True)
            return
        self._add_goodput(base, search.rate, "search", search.upper_bound)

    def goodput_from_loads(self, base: RunInfo) -> None:
        found = goodput_from_rows(self.rows, base.config)
        if found is not None:
            self._add_goodput(base, found[0], "listed rates", found[1])

    def _add_goodput(self, base: RunInfo, rate: float, source: str, upper_bound: float | None) -> None:
        per_engine = rate / base.num_engines
        self.goodputs.append({"config": base.config, "num_engines": base.num_engines, "goodput": rate,
                              "goodput_per_engine": per_engine, "source": source, "upper_bound": upper_bound})
        bound = f" (it misses at {upper_bound:g})" if upper_bound is not None else " (the highest rate tried)"
        self.progress.note(f"[pdserve sweep] {base.config}: goodput {rate:.3g} req/s{bound}, {per_engine:.3g} per "
                           "engine")

    def write_tables(self) -> None:
        write_csv(self.plan.output_dir / "summary.csv", self.rows, SUMMARY_COLUMNS)
        if self.goodputs:
            write_csv(self.plan.output_dir / "goodput.csv", self.goodputs, GOODPUT_COLUMNS)

    def commands_run(self) -> list[str]:
        """Each layout's `pdserve up` and one load's `pdserve bench`, as the sweep ran them."""
        from pdserve.bench.sweep_cluster import up_command
        from pdserve.bench.sweep_runs import bench_command

        commands = [up_command(self.plan.cluster, layout, self.plan.output_dir / "logs" / layout.name)
                    for layout in self.plan.layouts]
        load = next((row for row in self.rows if row.get("phase") == "sweep"), None)
        if load is not None:
            info = RunInfo(load["config"], load["num_engines"], "sweep", load["request_rate"], load["max_concurrency"])
            url = "http://127.0.0.1:PORT"
            commands.append(bench_command(self.plan.bench, url, info, self.runs_dir / "RUN.json"))
        key = self.plan.bench.api_key
        lines = [shlex.join(["pdserve", *command[3:]]) for command in commands]  # not `python -m pdserve`
        return [line.replace(key, "<api key>") if key else line for line in lines]

    def failures(self) -> list[dict]:
        return [row for row in self.rows if row.get("error")]


def load_text(info: RunInfo) -> str:
    """'2 req/s', 'inf req/s, concurrency 8'."""
    text = f"{format_rate(info.request_rate)} req/s"
    return text + (f", concurrency {info.max_concurrency}" if info.max_concurrency is not None else "")


def point_result(row: dict) -> str:
    """A run's line: how many requests completed, in how long, its SLO attainment and latencies."""
    if row.get("error"):
        return "failed (the error is above)"
    requests = (row.get("completed") or 0) + (row.get("failed") or 0)
    text = f"{row.get('completed') or 0}/{requests} requests in {row.get('duration') or 0:.1f} s"
    if row.get("slo_attainment") is not None:
        text += f", {row['slo_attainment']:.0%} within the SLOs"
    for name, field in (("TTFT", "p90_ttft_ms"), ("TPOT", "p90_tpot_ms")):
        if isinstance(row.get(field), (int, float)):
            text += f", {name} p90 {row[field]:.0f} ms"
    return text


def sweep_command() -> str | None:
    """This process's command line, when it is `pdserve sweep` (not when a test calls main())."""
    if sys.argv[1:2] != ["sweep"]:
        return None
    return shlex.join(["pdserve", *sys.argv[1:]])


def with_output_len(dataset_args: list[str], output_len: int) -> list[str]:
    """bench's dataset flags with --output-len set to output_len (replacing the sweep's)."""
    kept = [item for i, item in enumerate(dataset_args)
            if item != "--output-len" and (i == 0 or dataset_args[i - 1] != "--output-len")]
    return [*kept, "--output-len", str(output_len)]


def report(sweep: Sweep) -> None:
    """The comparison table and its sentence on the console and in summary.md; with plots, the PNGs and
    report.html."""
    from pdserve.bench.sweep_phase_report import phase_table
    from pdserve.bench.sweep_report import compare, describe_slos, describe_workload, markdown_table, write_summary_md

    plan = sweep.plan
    comparison = compare(sweep.rows, sweep.goodputs, plan.slos)
    workload = describe_workload(sweep.rows)
    phases = phase_table(sweep.rows)
    print(f"\n{markdown_table(comparison)}\n\nWorkload: {workload}; SLOs: {describe_slos(plan.slos)}.\n"
          f"{comparison.sentence}\n" + (f"\nPer phase:\n\n{phases}\n" if phases else ""), flush=True)
    write_summary_md(plan.output_dir / "summary.md", comparison, workload, plan.slos, phases)
    if not plan.plots:
        return
    from pdserve.bench.sweep_html import machine_facts, write_report
    from pdserve.bench.sweep_plots import PlotContext, write_plots

    loaded = [row for row in sweep.rows if row.get("phase") not in NOT_LOADS]
    context = PlotContext(f"{workload}; {describe_slos(plan.slos)}", plan.slos, comparison.winner)
    plots = write_plots(loaded, sweep.goodputs, plan.output_dir, context)
    commands = [command for command in [sweep_command()] if command] + sweep.commands_run()
    write_report(plan.output_dir / "report.html", comparison, workload, describe_slos(plan.slos),
                 machine_facts(plan.cluster.device, plan.cluster.dtype), commands, plots)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_sweep(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if plan.layouts and args.device != "cpu":
        from pdserve.engine.config import check_device

        check_device(args.device)  # before a layout starts, whose engines would each refuse it
    sweep = Sweep(plan)
    interrupted = False
    # SIGTERM (kill, timeout, a CI job cancelled) stops like Ctrl-C: each `pdserve up` in its own session is
    # stopped on the way out instead of left serving
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        sweep.run()
    except KeyboardInterrupt:
        interrupted = True
        print("[pdserve sweep] interrupted: writing what was measured", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        sweep.write_tables()
    if sweep.rows:
        report(sweep)
    failures = sweep.failures()
    finished = len(sweep.rows) - len(failures)
    print(f"[pdserve sweep] {finished} of {len(sweep.rows)} runs finished (warm-ups not counted); "
          f"results in {plan.output_dir}: summary.md, summary.csv" + (", report.html" if plan.plots else ""),
          flush=True)
    if interrupted:
        return 130
    return 1 if failures else 0
