"""CPU decode attention: the native kernel (kernels/cpu_native.py) against the torch plan it replaced
(kernels/torch_paged.py's gathers and batched matmuls), at the demo model's shape (9 heads, 3 KV heads of 64),
in turns, one layer's call each; the median time of each and the ratio, per batch, context and dtype.

    python experiments/cpu_decode_kernel.py [--threads 1] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.kernels import cpu_native, torch_paged

SHAPES = [(1, 256), (8, 320), (32, 192), (8, 1024), (1, 4096)]  # (batch, context)


def paged_cache(batch: int, context: int, dtype: torch.dtype, block_size: int = 16):
    heads, kv_heads, head_dim = 9, 3, 64
    per_seq = (context + block_size - 1) // block_size
    num_blocks = batch * per_seq
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks).to(torch.int32).view(batch, per_seq)  # scattered blocks
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return torch.randn(batch, heads, head_dim).to(dtype), key_cache, value_cache, tables, seq_lens


def timed(call, repeats: int) -> list[float]:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_native.decode_kernel() is None:
        raise SystemExit(f"no native kernel: {cpu_native.unavailable_reason()}")
    print(f"threads {torch.get_num_threads()}, medians of {args.repeats} calls each, in turns")
    print("| dtype | batch | context | torch plan (us) | native (us) | torch / native |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for dtype in (torch.bfloat16, torch.float32):
        for batch, context in SHAPES:
            query, key_cache, value_cache, tables, seq_lens = paged_cache(batch, context, dtype)

            def torch_plan():
                plan = torch_paged.plan_decode(tables, seq_lens, 16)
                return torch_paged.decode_attention_planned(query, key_cache, value_cache, plan, 0.125)

            def native():
                return cpu_native.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.125)

            plain, fused = [], []
            for _ in range(3):  # in turns, so a slow spell of the host falls on both
                plain += timed(torch_plan, args.repeats // 3)
                fused += timed(native, args.repeats // 3)
            a, b = statistics.median(plain) * 1e6, statistics.median(fused) * 1e6
            print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {context} | {a:.0f} | {b:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
