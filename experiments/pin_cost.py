"""What pinning engines to their own cores does under concurrent load: the same `pdserve bench` load against
`pdserve up` with each engine pinned to cores of its own (`--pin-cpus`, a thread per core) and unpinned
(torch's threads, the scheduler placing them), in one run, the two modes alternating (ABBA ...) so that drift
on a shared machine falls on both. Prints medians over the repeats and the pinned/unpinned ratio of each figure.

    python experiments/pin_cost.py --model DIR --layout 1P1D --repeats 2 \
        --num-prompts 24 --input-len 256 --output-len 32 --max-concurrency 4
"""

from __future__ import annotations

import argparse

from pdserve.bench.sweep_cluster import ClusterSpec

from ab_runs import add_load_args, median_table, output_dir, run_alternating, save_and_print  # experiments/ab_runs.py
from ab_runs import mode_order as ab_order
from curve_cost import FIGURES, bench_against_up

MODES = ("pinned", "unpinned")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--layout", default="1P1D", help="xPyD layout of each `pdserve up` (its engines fit the cores)")
    add_load_args(parser, num_prompts=24)
    parser.add_argument("--max-concurrency", type=int, default=4, help="requests in flight: a concurrent load")
    return parser.parse_args(argv)


def mode_order(repeats: int) -> list[str]:
    return ab_order(MODES, repeats)


def report(results: dict[str, list[dict]]) -> str:
    return median_table(results, MODES, ("pinned", "unpinned"), FIGURES)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = output_dir(args.output_dir, "pdserve-pin-cost-")

    def one_run(mode: str, index: int) -> dict:
        figures = bench_against_up(args, ClusterSpec(model=args.model, pin_cpus=mode == "pinned"), mode, index, out)
        print(f"[pin_cost] run {index} {mode}: {figures}", flush=True)
        return figures

    results = run_alternating(MODES, args.repeats, one_run)
    return save_and_print(results, out, "pin_cost", report(results))


if __name__ == "__main__":
    raise SystemExit(main())
