"""CPU decode attention: the native kernel (kernels/cpu_native.py) against the torch plan it replaced
(kernels/torch_paged.py's gathers and batched matmuls), at the demo model's shape (9 heads, 3 KV heads of 64),
in turns, one layer's call each; the median time of each and the ratio, per batch, context and dtype. With
--prefill, bf16 prefill attention instead: the native kernel (kernels/cpu_prefill.py) against the gather and
torch's SDPA, per batch of prompts, new tokens and cached prefix.

    python experiments/cpu_decode_kernel.py [--threads 1] [--repeats 30] [--prefill]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.kernels import cpu_native, cpu_prefill, torch_paged

SHAPES = [(1, 256), (8, 320), (32, 192), (8, 1024), (1, 4096)]  # (batch, context)
PREFILL_SHAPES = [(1, 256, 0), (8, 256, 0), (1, 1000, 0), (1, 4096, 0), (4, 256, 768)]  # (prompts, new, prefix)


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
    parser.add_argument("--prefill", action="store_true", help="bf16 prefill attention instead of decode")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefill:
        return prefill_table(args.repeats)
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

            a, b = in_turns(torch_plan, native, args.repeats)
            print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {context} | {a:.0f} | {b:.0f} | {a / b:.2f} |")


def in_turns(first, second, repeats: int) -> tuple[float, float]:
    """Median microseconds of each, timed in three turns so a slow spell of the host falls on both."""
    a, b = [], []
    for _ in range(3):
        a += timed(first, repeats // 3)
        b += timed(second, repeats // 3)
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6


def prefill_table(repeats: int) -> None:
    if cpu_prefill.prefill_kernel() is None:
        raise SystemExit(f"no native prefill kernel: {cpu_prefill.unavailable_reason()}")
    print(f"threads {torch.get_num_threads()}, bf16, medians of {repeats} calls each, in turns")
    print("| prompts | new tokens | cached prefix | gather + SDPA (us) | native (us) | ratio | native GFLOP/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for prompts, new, prefix in PREFILL_SHAPES:
        _, key_cache, value_cache, tables, seq_lens = paged_cache(prompts, prefix + new, torch.bfloat16)
        query = torch.randn(prompts * new, 9, 64).bfloat16()
        starts = torch.arange(0, prompts * new + 1, new, dtype=torch.int32)
        plan = torch_paged.plan_prefill(tables, starts, seq_lens, 16)
        a, b = in_turns(lambda: torch_paged.prefill_attention_planned(query, key_cache, value_cache, plan, 0.125),
                        lambda: cpu_prefill.paged_prefill(query, key_cache, value_cache, tables, starts, seq_lens,
                                                          0.125), repeats)
        flops = 4 * 9 * 64 * prompts * new * (prefix + (new + 1) / 2)  # QK and PV over each row's visible keys
        print(f"| {prompts} | {new} | {prefix} | {a:.0f} | {b:.0f} | {a / b:.2f} | {flops / b / 1e3:.0f} |")


if __name__ == "__main__":
    main()
