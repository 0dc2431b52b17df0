"""CPU linears: pdserve's kernel (kernels/cpu_gemm_bf16.c, or with --dtype float32 kernels/cpu_gemm_f32.c) against
oneDNN's packed product it replaced, in turns, in one process.

Two measurements:
- one model step's linears with cold weights: the demo model's 30 layers (qkv 960x576, o 576x576, gate_up
  3072x576, down 576x1536) and its 49152x576 lm_head, 269 MB of bf16 weights (538 MB of float32) that no cache
  holds, at each row count; median time and the read bandwidth it implies;
- one linear with its weight in cache, per shape and row count: multiply-adds per second.

    python experiments/cpu_linear_kernel.py [--dtype bfloat16|float32] [--threads 2] [--rows 1 8 32] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.kernels import cpu_gemm, cpu_gemm_f32

KERNELS = {torch.bfloat16: cpu_gemm, torch.float32: cpu_gemm_f32}  # pdserve's kernel for each dtype
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per decoder layer
LAYERS, VOCAB = 30, 49152


def onednn_linear(weight: torch.Tensor):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def native_linear(weight: torch.Tensor):
    kernel = KERNELS[weight.dtype]
    packed, out_features = kernel.pack_weight(weight), weight.shape[0]
    return lambda x: kernel.linear(x, packed, out_features)


def model_linears(make, dtype: torch.dtype) -> list[tuple[int, object]]:  # [(in_features, call)] in a step's order
    torch.manual_seed(0)
    calls = [(k, make(torch.randn(n, k, dtype=dtype))) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    return calls + [(576, make(torch.randn(VOCAB, 576, dtype=dtype)))]


def step_seconds(linears, rows: int, repeats: int, dtype: torch.dtype) -> list[float]:
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        for in_features, call in linears:
            call(inputs[in_features])
        times.append(time.perf_counter() - start)
    return times[1:]


def cold_steps(rows_list: list[int], repeats: int, dtype: torch.dtype) -> None:
    weight_bytes = dtype.itemsize * (LAYERS * sum(n * k for n, k in LAYER_SHAPES) + VOCAB * 576)
    kernels = {"oneDNN": model_linears(onednn_linear, dtype), "pdserve": model_linears(native_linear, dtype)}
    print(f"one step's linears, cold weights ({weight_bytes / 1e6:.0f} MB), median ms (GB/s read)")
    print("rows  oneDNN           pdserve          oneDNN/pdserve")
    for rows in rows_list:
        times = {name: [] for name in kernels}
        for _ in range(repeats):  # in turns, so a busy moment hits both
            for name, linears in kernels.items():
                times[name] += step_seconds(linears, rows, 1, dtype)
        median = {name: statistics.median(values) for name, values in times.items()}
        cells = [f"{median[name] * 1e3:6.1f} ({weight_bytes / median[name] / 1e9:4.1f})" for name in kernels]
        print(f"{rows:4d}  {cells[0]:15s}  {cells[1]:15s}  {median['oneDNN'] / median['pdserve']:.2f}")


def hot_products(rows_list: list[int], repeats: int, dtype: torch.dtype) -> None:
    print("one linear, weight in cache, GMAC/s")
    print("shape       rows  oneDNN  pdserve  pdserve/oneDNN")
    for out_features, in_features in LAYER_SHAPES:
        weight = torch.randn(out_features, in_features, dtype=dtype)
        calls = {"oneDNN": onednn_linear(weight), "pdserve": native_linear(weight)}
        for rows in rows_list:
            x = torch.randn(rows, in_features, dtype=dtype)
            inner = max(3, int(2e7 / (rows * out_features * in_features)))
            best = {}
            for name, call in calls.items():
                call(x)
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(inner):
                        call(x)
                    samples.append((time.perf_counter() - start) / inner)
                best[name] = rows * out_features * in_features / min(samples) / 1e9
            print(f"{out_features}x{in_features:<5d} {rows:4d}  {best['oneDNN']:6.0f}  {best['pdserve']:7.0f}  "
                  f"{best['pdserve'] / best['oneDNN']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the linears' dtype (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: %(default)s)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256], help="row counts (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per measurement (default: %(default)s)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernel = KERNELS[dtype]
    if kernel.packed_gemm() is None:
        raise SystemExit(f"pdserve's {args.dtype} kernel does not run here: {kernel.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    print(f"{args.dtype}, torch threads {args.threads}")
    cold_steps(args.rows, args.repeats, dtype)
    hot_products(args.rows, args.repeats, dtype)


if __name__ == "__main__":
    main()
