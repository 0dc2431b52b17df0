"""Where a served decode step's milliseconds go: one engine under `pdserve up`, pinned as `pdserve sweep` pins
it (one core per engine; the router and the bench client where a sweep leaves them), at one online load, its
loop timed part by part (GEMMs, attention, gathers, sampling, the engine loop, zmq) with the time its main
thread waited for a core; the router's CPU per token (detokenization apart) and, with --security both, what
CURVE adds. Then the offline engine's step at the same batch and context on the same core, and the ratio.

    python experiments/serve_profile.py --dtype bfloat16 --out-dir /tmp/serve-profile
        (the demo model, 1P1D, 16 requests, 8 in flight, 256 in, 64 out; decode-0 profiled)

Writes breakdown.json and breakdown.md under --out-dir and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import serve_profile_report
from serve_profile_entry import HERE as ENTRY

from pdserve.bench import sweep_cluster
from pdserve.bench.sweep_cluster import Cluster, ClusterSpec
from pdserve.bench.sweep_layouts import parse_layout

ENGINE_JSON_TIMEOUT_S = 300.0
CPU_SAMPLE_S = 0.1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layout", default="1P1D", help="xPyD; the first decode engine is profiled")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=None, help="decode batch to break down (default: concurrency)")
    parser.add_argument("--security", choices=["curve", "insecure", "both"], default="curve")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline step on the same core")
    parser.add_argument("--out-dir", default="serve-profile")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    return parser.parse_args(argv)


def profiled_up_command(spec: ClusterSpec, layout, log_dir: Path) -> list[str]:
    """The sweep's `pdserve up` command, run through serve_profile_entry.py's `up` mode."""
    command = original_up_command(spec, layout, log_dir)
    if command[1:4] != ["-m", "pdserve", "up"]:
        raise RuntimeError(f"unexpected `pdserve up` command {command[:4]}: update {Path(__file__).name}")
    return [command[0], str(ENTRY), "up", *command[4:]]


original_up_command = sweep_cluster.up_command


def run_load(args: argparse.Namespace, mode: str, model: str) -> dict:
    """One `pdserve up` at the load, decode-0 timed between the warm-up and the end of the load."""
    folder = Path(args.out_dir, mode).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for marker in ("start", "stop", "engine.json"):
        (folder / marker).unlink(missing_ok=True)
    os.environ.update(SERVE_PROFILE_DIR=str(folder), SERVE_PROFILE_ENGINE="decode-0")  # `up` passes them on
    up_args = ["--dtype", args.dtype, *(["--insecure"] if mode == "insecure" else [])]
    spec = ClusterSpec(model, up_args=up_args, startup_timeout_s=args.startup_timeout)
    layout = parse_layout(args.layout)
    sweep_cluster.up_command = profiled_up_command
    try:
        with Cluster(spec, layout, folder / "logs") as cluster:
            bench(args, cluster, folder / "warmup.json", warmup=True)
            router = router_pid(cluster.process.pid)
            (folder / "start").touch()
            result, router_ms, client_ms = bench(args, cluster, folder / "bench.json", watch=router)
            (folder / "stop").touch()
            engine = wait_json(folder / "engine.json")
    finally:
        sweep_cluster.up_command = original_up_command
        for name in ("SERVE_PROFILE_DIR", "SERVE_PROFILE_ENGINE"):
            os.environ.pop(name, None)
    tokens = max(1, result.get("total_output_tokens", 0))
    return {"layout": layout.name, "dtype": args.dtype, "engine": engine, "bench": result,
            "outside": {"router_cpu_ms_per_token": router_ms / tokens, "client_cpu_ms_per_token": client_ms / tokens}}


def bench(args: argparse.Namespace, cluster: Cluster, result_path: Path, warmup: bool = False,
          watch: int | None = None):
    """`pdserve bench` at the load (or a short warm-up at its concurrency), where a sweep runs it. With `watch`
    (the router's pid): (bench's JSON, the router's and the bench client's CPU ms over the load's duration)."""
    shape = (["--num-prompts", str(args.max_concurrency), "--input-len", "32", "--output-len", "8"] if warmup else
             ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
              "--output-len", str(args.output_len)])
    command = [sys.executable, "-m", "pdserve", "bench", "--base-url", cluster.url, *shape,
               "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--disable-progress",
               "--save-result", str(result_path)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    if cluster.client_cores:
        os.sched_setaffinity(process.pid, cluster.client_cores)
    samples = []  # (time, router CPU ms, client CPU ms) while bench runs, and once after it ended
    while process.poll() is None:
        if watch is not None:
            samples.append((time.monotonic(), cpu_ms_of(watch), cpu_ms_of(process.pid)))
        time.sleep(CPU_SAMPLE_S)
    if watch is not None and samples:  # the client's figure stays its last reading (it has exited)
        samples.append((time.monotonic(), cpu_ms_of(watch), samples[-1][2]))
    if process.returncode != 0:
        raise RuntimeError(f"pdserve bench exited with code {process.returncode}: {' '.join(command)}")
    result = json.loads(result_path.read_text())
    if watch is None:
        return result
    router_ms, client_ms = cpu_over_load(samples, result["duration"])
    if "client_cpu_s" in result:  # the client's own reading over the load: the samples' window can reach its start-up
        client_ms = 1e3 * result["client_cpu_s"]
    return result, router_ms, client_ms


def cpu_over_load(samples: list[tuple[float, float, float]], duration_s: float) -> tuple[float, float]:
    """The router's and the client's CPU ms over the load: the last `duration_s` of the samples (bench's
    start-up, its tokenizer and prompts, comes before)."""
    if not samples:
        return 0.0, 0.0
    end = samples[-1]
    # the last reading taken before the load began (bench's own start-up before it), else the first
    start = next((s for s in reversed(samples) if s[0] <= end[0] - duration_s), samples[0])
    return end[1] - start[1], end[2] - start[2]


def router_pid(up_pid: int) -> int:
    """The router among `pdserve up`'s children (its command line says `router`)."""
    for pid in children(up_pid):
        if b"router" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return pid
    raise RuntimeError(f"no router among pdserve up's (pid {up_pid}) children")


def children(pid: int) -> list[int]:
    """A process's children: /proc's list, or (a kernel without it) every process whose parent it is."""
    listed = Path(f"/proc/{pid}/task/{pid}/children")
    if listed.exists():
        return [int(child) for child in listed.read_text().split()]
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def cpu_ms_of(pid: int) -> float:
    """All threads' time on a core, ms."""
    total = 0
    if not os.path.isdir(f"/proc/{pid}/task"):
        return 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            continue
    return total / 1e6


def wait_json(path: Path) -> dict:
    deadline = time.monotonic() + ENGINE_JSON_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the profiled engine wrote no {path} within {ENGINE_JSON_TIMEOUT_S:g}s: see its log")
        time.sleep(0.1)
    return json.loads(path.read_text())


def detokenize_ms_per_token(model: str, num_requests: int, output_len: int) -> float:
    """CPU of pdserve's incremental detokenizer per token, as the router runs it (random token ids)."""
    import random

    from pdserve.engine.detokenizer import IncrementalDetokenizer
    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    rng = random.Random(0)
    streams = [[rng.randrange(tokenizer.vocab_size) for _ in range(output_len)] for _ in range(num_requests)]
    start = time.thread_time()
    for stream in streams:
        detokenizer = IncrementalDetokenizer(tokenizer, stream[:8])
        for token in stream:
            detokenizer.add_tokens([token])
            detokenizer.take_new_text()
    return (time.thread_time() - start) * 1e3 / (num_requests * output_len)


def run_offline(args: argparse.Namespace, model: str, cores: list[int], folder: Path) -> dict:
    """The offline engine's steps at the batch, alone on the profiled engine's cores, its thread count."""
    out = folder / "offline.json"
    command = [sys.executable, str(ENTRY), "offline", "--model", model, "--dtype", args.dtype,
               "--batch", str(args.batch), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
    subprocess.run(command, env=env, check=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))  # noqa: PLW1509
    return json.loads(out.read_text())


def machine(loadavg_before: str) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_before": loadavg_before,
            "loadavg_after": Path("/proc/loadavg").read_text().split(" ", 3)[:3]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.batch = args.batch or args.max_concurrency
    loadavg = Path("/proc/loadavg").read_text().split(" ", 3)[:3]
    from pdserve.demo_model import default_demo_model

    model = str(Path(args.model).resolve()) if args.model else str(default_demo_model())
    modes = ["curve", "insecure"] if args.security == "both" else [args.security]
    detokenize_ms = detokenize_ms_per_token(model, args.num_prompts, args.output_len)
    runs = {}
    for mode in modes:
        gathered = run_load(args, mode, model)
        engine = gathered["engine"]
        gathered["outside"]["detokenize_ms_per_token"] = detokenize_ms
        runs[mode] = {**{k: v for k, v in gathered.items() if k != "engine"},
                      "step": serve_profile_report.step_breakdown(engine["rounds"], args.batch),
                      "threads": serve_profile_report.thread_costs(engine), "cores": engine["cores"]}
    report = {"settings": vars(args), "model": model, "runs": runs, "machine": machine(loadavg)}
    if not args.no_offline:
        first = runs[modes[0]]
        offline = run_offline(args, model, first["cores"], Path(args.out_dir).resolve())
        report["offline"] = serve_profile_report.offline_step(offline, first["step"]["batch"])
        report["served_over_offline"] = first["step"]["step_median_ms"] / report["offline"]["step_median_ms"]
        report["served_over_offline_less_wait"] = (first["step"]["step_less_wait_median_ms"]
                                                   / report["offline"]["step_less_wait_median_ms"])
    for run in runs.values():
        run["bench"] = {k: v for k, v in run["bench"].items() if not isinstance(v, list)}
    text = serve_profile_report.markdown(report)
    Path(args.out_dir, "breakdown.json").write_text(json.dumps(report, indent=2))
    Path(args.out_dir, "breakdown.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
