"""One run of a sweep: `pdserve bench` as a subprocess at one load against one server, with the server's
/metrics scraped around it; its JSON gets the sweep's own figures under "sweep" and "server_metrics"."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.sweep_metrics import RunMetrics
from pdserve.bench.sweep_results import RunInfo, summary_row

OUTPUT_TAIL_CHARS = 2000
BENCH_COMMAND = (sys.executable, "-m", "pdserve", "bench")
WARMUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class BenchOptions:
    """What every run of a sweep passes to `pdserve bench`, whatever the server and load."""
    model: str
    num_prompts: int | None  # None: the whole schedule of a phased or trace dataset
    seed: int = 0  # a run's prompts come from seed + its index among the server's runs
    dataset_args: list[str] = field(default_factory=list)  # --dataset ..., --input-len ..., --seed ..., as given
    goodput: list[str] = field(default_factory=list)  # ["ttft:500", "tpot:50"]
    ignore_eos: bool = True
    api_key: str | None = None
    extra_args: list[str] = field(default_factory=list)  # anything else for bench, as given
    metrics_interval_s: float = 1.0
    timeout_s: float | None = None


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run_name(info: RunInfo) -> str:
    load = f"rate{format_rate(info.request_rate)}"
    if info.max_concurrency is not None:
        load += f"_conc{info.max_concurrency}"
    suffix = f"_{info.phase}" if info.phase != "sweep" else ""  # _search, _unloaded
    return f"{info.config}_{load}{suffix}"


def bench_command(options: BenchOptions, url: str, info: RunInfo, result_path: Path, run_index: int = 0) -> list[str]:
    count = ["--num-prompts", str(options.num_prompts)] if options.num_prompts is not None else []
    command = [*BENCH_COMMAND, "--base-url", url, "--model", options.model, *count,
               "--request-rate", format_rate(info.request_rate),
               "--seed", str(options.seed + run_index), *options.dataset_args, "--save-result", str(result_path)]
    if info.max_concurrency is not None:
        command += ["--max-concurrency", str(info.max_concurrency)]
    if options.ignore_eos:
        command.append("--ignore-eos")
    if options.goodput:
        command += ["--goodput", *options.goodput]
    if options.api_key:
        command += ["--api-key", options.api_key]
    metadata = [f"config={info.config}", f"rate={format_rate(info.request_rate)}", f"phase={info.phase}"]
    return command + options.extra_args + ["--metadata", *metadata]


def run_bench(options: BenchOptions, url: str, info: RunInfo, runs_dir: Path, slos: dict[str, float],
              run_index: int = 0, client_cores: list[int] | None = None, name: str | None = None,
              order: int | None = None) -> tuple[dict, dict | None]:
    """(summary row, bench's JSON or None when it failed); a failed run is a row with its error, not a crash.
    `client_cores`: where bench runs (cores the engines do not have), when there are any. `name`: the run file's
    name instead of run_name(info); `order`: the run's place among its server's runs, kept in its JSON."""
    result_path = runs_dir / f"{name or run_name(info)}.json"
    result_path.unlink(missing_ok=True)
    command = bench_command(options, url, info, result_path, run_index)
    with RunMetrics(url, options.api_key, options.metrics_interval_s) as metrics:
        try:
            error = _run(command, options.timeout_s, client_cores)
        except BaseException:  # Ctrl-C: what bench saved of its interrupted load is no run of the sweep
            result_path.unlink(missing_ok=True)
            raise
    result = None
    if not error:
        try:
            result = json.loads(result_path.read_text())
        except (OSError, ValueError) as exc:
            error = f"pdserve bench wrote no readable result at {result_path}: {exc}"
    figures = metrics.summary()
    if result is not None:
        result["sweep"] = {"config": info.config, "phase": info.phase, "request_rate": format_rate(info.request_rate),
                           "max_concurrency": info.max_concurrency, "num_engines": info.num_engines,
                           "num_prefill": info.num_prefill, "num_decode": info.num_decode,
                           **({} if info.dtype is None else {"dtype": info.dtype}),
                           **({} if order is None else {"order": order})}
        result["server_metrics"] = figures
        result_path.write_text(json.dumps(result, indent=2))
    if error:
        print(f"[pdserve sweep] {info.config}: run failed: {error}", file=sys.stderr, flush=True)
    row = summary_row(info, result, figures, slos, str(result_path) if result is not None else "", error)
    return row, result


def warm_up(options: BenchOptions, url: str, count: int, max_tokens: int = 8) -> int:
    """`count` short completions at once, before a server's first run and outside its /metrics window (first
    steps, allocator, threads); returns how many succeeded."""
    if count < 1:
        return 0
    body = json.dumps({"model": options.model, "prompt": "Warm up the server.", "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json",
               **({"Authorization": f"Bearer {options.api_key}"} if options.api_key else {})}

    def one(_: int) -> bool:
        request = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=WARMUP_TIMEOUT_S) as response:
                response.read()
            return True
        except (OSError, ValueError) as exc:
            print(f"[pdserve sweep] warm-up request failed: {exc}", file=sys.stderr, flush=True)
            return False

    with ThreadPoolExecutor(max_workers=min(count, 16)) as pool:
        return sum(pool.map(one, range(count)))


def _run(command: list[str], timeout_s: float | None, cores: list[int] | None) -> str:
    """'' when bench exited 0, else why not. Its table is not shown (its figures are in the run's JSON, and the
    sweep prints a line per run); the end of its stderr is kept for the error."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if cores:  # at once, before its imports start threads (they inherit it)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(process.pid, cores)
    tail = bytearray()
    reader = threading.Thread(target=_keep_tail, args=(process.stderr, tail), daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return f"pdserve bench ran past --run-timeout {timeout_s:g}s"
    except BaseException:  # Ctrl-C: bench got it too; do not leave it behind
        process.kill()
        process.wait()
        raise
    finally:
        reader.join(timeout=5)
    if process.returncode != 0:
        text = tail.decode(errors="replace").replace("\r", "\n").strip()
        return f"pdserve bench exited with code {process.returncode}: {text}"
    return ""


def _keep_tail(stream, tail: bytearray) -> None:
    while chunk := stream.read1(4096):
        tail.extend(chunk)
        del tail[:-OUTPUT_TAIL_CHARS]
