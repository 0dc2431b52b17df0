"""The bf16 linear kernel (kernels/cpu_gemm_bf16.c) as it is against the same file at an earlier commit, in turns in
one process, on 2 threads: made for the change that split the work evenly over threads (rows for prompts, half
panels for decode steps) where whole panels had left one thread 5 of 9.

Two measurements, each the median of --repeats pairs taken in turns (old, new, old, new ...):
- one linear of each demo-model shape, its weight in cache, at each row count: ms and GFLOP/s;
- one model step's linears (30 layers, weights 212 MB, no cache holds them) at each row count: ms.

    python experiments/gemm_thread_split.py [--against f418cb4] [--rows 8 256 2048] [--threads 2] [--repeats 41]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from cpu_linear_kernel import LAYER_SHAPES, LAYERS  # the demo model's (out, in) per decoder layer, 30 layers
from pdserve.kernels import cpu_gemm, cpu_native

SIGNATURE = {"pdserve_gemm_bf16": (ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4)}


def kernel_at(commit: str, scratch: Path):
    """The kernel function built from cpu_gemm_bf16.c as it was at `commit` (headers as they are now)."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True, cwd=cpu_gemm.SOURCE.parent).stdout.strip())
    shown = subprocess.run(["git", "show", f"{commit}:kernels/cpu_gemm_bf16.c"], capture_output=True, text=True,
                           cwd=root)
    if shown.returncode != 0:
        raise SystemExit(f"--against {commit}: no kernels/cpu_gemm_bf16.c there ({shown.stderr.strip()[:200]}); "
                         "give a commit of this repository that has it (git log kernels/cpu_gemm_bf16.c)")
    text = shown.stdout
    source = scratch / "cpu_gemm_bf16.c"
    source.write_text(text)
    for header in cpu_gemm.SOURCE.parent.glob("*.h"):
        shutil.copy(header, scratch / header.name)
    bound = cpu_native.functions(source, SIGNATURE)
    if bound is None:
        raise SystemExit(f"the kernel at {commit} did not build: {cpu_native.unavailable_reason(source)}")
    return bound[0]


def timed(kernel, calls, rows: int, threads: int) -> float:
    """Seconds for every (packed, in, out) product in `calls` at `rows` rows."""
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k, _ in calls}
    outputs = {n: torch.empty(rows, n, dtype=torch.bfloat16) for _, _, n in calls}
    start = time.perf_counter()
    for packed, k, n in calls:
        kernel(inputs[k].data_ptr(), packed.data_ptr(), None, outputs[n].data_ptr(), rows, k, n, threads)
    return time.perf_counter() - start


def in_turns(kernels: dict, calls, rows: int, threads: int, repeats: int) -> dict[str, float]:
    times = {name: [] for name in kernels}
    for _ in range(repeats + 1):  # the first round warms up
        for name, kernel in kernels.items():
            times[name].append(timed(kernel, calls, rows, threads))
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="f418cb4", help="the earlier commit (default: before the even split)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 256, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    if cpu_gemm.packed_gemm() is None:
        raise SystemExit(f"pdserve's bf16 kernel does not run here: {cpu_gemm.unavailable_reason()}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {args.against: kernel_at(args.against, Path(scratch)), "now": cpu_gemm.packed_gemm()}
        print(f"{args.threads} threads; medians of {args.repeats} in turns; {args.against} / now")
        for n, k in LAYER_SHAPES:
            calls = [(cpu_gemm.pack_weight(torch.randn(n, k, dtype=torch.bfloat16)), k, n)]
            for rows in args.rows:
                old, new = in_turns(kernels, calls, rows, args.threads, args.repeats).values()
                print(f"in cache {k}x{n:<5} rows {rows:>5}: {old * 1e3:8.3f} / {new * 1e3:8.3f} ms = {old / new:.3f}"
                      f"  ({2 * rows * k * n / new / 1e9:.0f} GFLOP/s now)")
        step = [(cpu_gemm.pack_weight(torch.randn(n, k, dtype=torch.bfloat16)), k, n)
                for _ in range(LAYERS) for n, k in LAYER_SHAPES]
        for rows in args.rows:
            old, new = in_turns(kernels, step, rows, args.threads, max(5, args.repeats // 4)).values()
            print(f"a step's linears, cold, rows {rows:>5}: {old * 1e3:8.2f} / {new * 1e3:8.2f} ms = {old / new:.3f}")


if __name__ == "__main__":
    main()
