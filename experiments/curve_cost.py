"""What CURVE-by-default costs: the same `pdserve bench` load against `pdserve up` with the cluster's keys
(every plane encrypted and authenticated) and with `--insecure` (plaintext), in one run, the two modes
alternating (ABBA ...) so that drift on a shared machine falls on both. Prints medians over the repeats
and the CURVE/plaintext ratio of each figure.

    python experiments/curve_cost.py --model DIR --layout 1P1D --repeats 2 \
        --num-prompts 24 --input-len 256 --output-len 32 --max-concurrency 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.bench.sweep_cluster import Cluster, ClusterSpec
from pdserve.bench.sweep_layouts import parse_layout
from pdserve.bench.sweep_results import RunInfo
from pdserve.bench.sweep_runs import BenchOptions

from ab_runs import add_load_args, bench_figures, median_table, output_dir, run_alternating  # experiments/ab_runs.py
from ab_runs import save_and_print
from ab_runs import mode_order as ab_order

MODES = {"curve": [], "insecure": ["--insecure"]}
FIGURES = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_itl_ms", "output_throughput")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--layout", default="1P1D", help="xPyD layout of each `pdserve up`")
    add_load_args(parser, num_prompts=24)
    parser.add_argument("--max-concurrency", type=int, default=4)
    return parser.parse_args(argv)


def mode_order(repeats: int) -> list[str]:
    return ab_order(("curve", "insecure"), repeats)


def one_run(args: argparse.Namespace, mode: str, index: int, out: Path) -> dict:
    return bench_against_up(args, ClusterSpec(model=args.model, up_args=MODES[mode]), mode, index, out)


def bench_against_up(args: argparse.Namespace, spec: ClusterSpec, mode: str, index: int, out: Path) -> dict:
    """One `pdserve up` of args.layout started as `spec` says, warmed, and one bench load against it: FIGURES."""
    layout = parse_layout(args.layout)
    options = BenchOptions(model=args.model, num_prompts=args.num_prompts, seed=index,
                           dataset_args=["--dataset", "random", "--input-len", str(args.input_len),
                                         "--output-len", str(args.output_len)])
    info = RunInfo(config=f"{layout.name}-{mode}-{index}", num_engines=layout.num_engines, phase="sweep",
                   request_rate=float("inf"), max_concurrency=args.max_concurrency,
                   num_prefill=layout.num_prefill, num_decode=layout.num_decode)
    with Cluster(spec, layout, out / f"{mode}-{index}") as cluster:
        return bench_figures(options, cluster.url, info, out, FIGURES, cluster.client_cores)


def report(results: dict[str, list[dict]]) -> str:
    return median_table(results, ("curve", "insecure"), ("CURVE", "--insecure"), FIGURES)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = output_dir(args.output_dir, "pdserve-curve-cost-")
    results = run_alternating(tuple(MODES), args.repeats, lambda mode, index: one_run(args, mode, index, out))
    return save_and_print(results, out, "curve_cost", report(results))


if __name__ == "__main__":
    raise SystemExit(main())
