"""What containers cost: the same `pdserve bench` load against compose.cpu.yaml's 1P1D stack run with
podman-compose and against the same layout as bare processes (`pdserve up`, unpinned like the containers),
in one run, alternating (ABBA ...) so that drift on a shared machine falls on both. Both serve the demo
model from the stack's volume, so the weights and tokenizer are the same files. Prints medians and ratios.

    python experiments/container_cost.py --repeats 2 --num-prompts 16 --input-len 256 --output-len 32 \
        --request-rate 1

Needs podman, podman-compose and the built image (deploy/container_smoke.sh makes all three).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from pdserve.bench.sweep_cluster import Cluster, ClusterSpec
from pdserve.bench.sweep_layouts import parse_layout
from pdserve.bench.sweep_results import RunInfo
from pdserve.bench.sweep_runs import BenchOptions

from ab_runs import add_load_args, bench_figures, median_table, output_dir, run_alternating  # experiments/ab_runs.py
from ab_runs import save_and_print
from ab_runs import mode_order as ab_order

PROJECT = "pdserve-cpu-bench"
POLICIES = ["--prefill-policy", "prefix_aware", "--decode-policy", "least_kv"]  # compose.cpu.yaml's router
FIGURES = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_e2el_ms", "output_throughput")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compose-file", default="compose.cpu.yaml")
    add_load_args(parser, num_prompts=16)
    parser.add_argument("--request-rate", type=float, default=1.0)
    return parser.parse_args(argv)


class ComposeStack:
    """compose.cpu.yaml up (its own project and port) until the router has both engines; down, volumes kept."""

    def __init__(self, compose_file: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.command = ["podman-compose", "--in-pod", "false", "-f", compose_file, "-p", PROJECT]
        self.url = f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str) -> None:
        env = {**os.environ, "PDSERVE_PORT": str(self.port)}
        subprocess.run([*self.command, *args], env=env, check=True, capture_output=True, timeout=900)

    def __enter__(self) -> None:
        self.compose("up", "-d")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if _engines_up(self.url) == 2:
                return
            time.sleep(2)
        raise TimeoutError(f"the compose stack at {self.url} did not register two engines within 600s")

    def __exit__(self, *exc) -> None:
        self.compose("down", "-t", "20")

    def model_dir(self, into: Path) -> Path:
        """A copy of the demo model the stack serves (from its volume), for the bare processes."""
        mount = subprocess.run(["podman", "volume", "inspect", "--format", "{{.Mountpoint}}",
                                f"{PROJECT}_demo-model"], check=True, capture_output=True, text=True).stdout.strip()
        target = into / "pdserve-demo"
        if not target.is_dir():
            shutil.copytree(Path(mount) / "pdserve-demo", target)
        return target


def _engines_up(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0
    return sum(line.startswith("pdserve_engine_up{") and line.endswith(" 1.0") for line in text.splitlines())


def mode_order(repeats: int) -> list[str]:
    """Containers first: their volume holds the model the bare processes load."""
    return ab_order(("containers", "bare"), repeats)


def bench_once(options: BenchOptions, url: str, name: str, out: Path, request_rate: float) -> dict:
    layout = parse_layout("1P1D")
    info = RunInfo(config=name, num_engines=layout.num_engines, phase="sweep", request_rate=request_rate,
                   max_concurrency=None, num_prefill=1, num_decode=1)
    return bench_figures(options, url, info, out, FIGURES)


def one_run(args: argparse.Namespace, mode: str, index: int, out: Path, stack: ComposeStack) -> dict:
    def options(model: str, extra_args: list[str]) -> BenchOptions:
        return BenchOptions(model=model, num_prompts=args.num_prompts, seed=index, extra_args=extra_args,
                            dataset_args=["--dataset", "random", "--input-len", str(args.input_len),
                                          "--output-len", str(args.output_len)])

    if mode == "containers":
        with stack:
            model = stack.model_dir(out)
            return bench_once(options("pdserve-demo", ["--tokenizer", str(model)]), stack.url, f"containers-{index}",
                              out, args.request_rate)
    model = stack.model_dir(out)
    spec = ClusterSpec(model=str(model), pin_cpus=False, up_args=POLICIES)
    with Cluster(spec, parse_layout("1P1D"), out / f"bare-{index}") as cluster:
        return bench_once(options(str(model), []), cluster.url, f"bare-{index}", out, args.request_rate)


def report(results: dict[str, list[dict]]) -> str:
    return median_table(results, ("containers", "bare"), ("containers", "bare processes"), FIGURES)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = output_dir(args.output_dir, "pdserve-container-cost-")
    stack = ComposeStack(args.compose_file)
    try:
        results = run_alternating(("containers", "bare"), args.repeats,
                                  lambda mode, index: one_run(args, mode, index, out, stack))
    finally:
        stack.compose("down", "-v", "-t", "5")
    return save_and_print(results, out, "container_cost", report(results))


if __name__ == "__main__":
    raise SystemExit(main())
