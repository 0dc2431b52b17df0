"""MLA attention on CPU: absorbed against decompressed (engine/layers/mla.py), at one real model's layer shape.

    python experiments/mla_attention.py [--repeats 5] [--iters 5] [--threads 1] [--clock cpu|wall] [--dtype float32]

One MLA layer of DeepSeek-V2-Lite's shape (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128; block size
16) over a latent cache whose blocks are scattered (a shuffled pool): decode steps of batch 1/8/32 at 1,024
tokens of context, a 1,024-token prefill, and a 512-token chunk after a 512-token cached prefix. Each case
runs the two modes in turns (A B B A ..), and prints the median time per layer call and the ratio
absorbed / decompressed (below 1: absorbed is faster). The step's plans are built once, outside the timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.engine.attention.torch_paged import TorchPagedBackend
from pdserve.engine.forward_context import ForwardContext, use_forward_context
from pdserve.engine.layers.mla import LatentAttention, LatentUpProjection

HEADS, LATENT, ROPE, NOPE, V_DIM, BLOCK = 16, 512, 64, 128, 128, 16
MODES = ("absorbed", "decompressed")
# (label, number of sequences, new tokens per sequence, context per sequence including them)
CASES = [("decode b1 x 1024", 1, 1, 1024), ("decode b8 x 1024", 8, 1, 1024), ("decode b32 x 1024", 32, 1, 1024),
         ("prefill 1024", 1, 1024, 1024), ("prefill 512 after 512", 1, 512, 1024)]


def make_layer(num_blocks: int, dtype: torch.dtype) -> LatentAttention:
    gen = torch.Generator().manual_seed(0)
    kv_b_proj = LatentUpProjection(LATENT, HEADS, NOPE, V_DIM).to(dtype)
    kv_b_proj.weight.data = (torch.randn(kv_b_proj.weight.shape, generator=gen) * LATENT ** -0.5).to(dtype)
    layer = LatentAttention(0, kv_b_proj, LATENT, ROPE, (NOPE + ROPE) ** -0.5)
    layer.bind_kv_cache(torch.randn(num_blocks, BLOCK, 1, LATENT + ROPE, generator=gen).to(dtype))
    return layer


def make_context(num_seqs: int, new_tokens: int, context: int, num_blocks: int) -> ForwardContext:
    per_seq = (context + BLOCK - 1) // BLOCK
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))[:num_seqs * per_seq]
    tables = tables.view(num_seqs, per_seq).int()
    positions = torch.arange(context - new_tokens, context)
    slots = (tables[:, positions // BLOCK].long() * BLOCK + positions % BLOCK).flatten()
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    decode = new_tokens == 1
    empty = tables[:0]
    return ForwardContext(
        slot_mapping=slots, num_decode_tokens=num_seqs if decode else 0,
        decode_block_tables=tables if decode else empty, decode_seq_lens=lens if decode else lens[:0],
        prefill_block_tables=empty if decode else tables,
        prefill_query_start_loc=torch.arange(0, (0 if decode else num_seqs) + 1, dtype=torch.int32) * new_tokens,
        prefill_seq_lens=lens[:0] if decode else lens)


def time_case(layer: LatentAttention, mode: str, context: ForwardContext, inputs: tuple, iters: int,
              clock) -> float:
    """Seconds per layer call in `mode` (the median of iters calls, after one warm-up call)."""
    layer.decode_mode = layer.prefill_mode = mode
    with use_forward_context(context, TorchPagedBackend(BLOCK)), torch.inference_mode():
        layer(*inputs)
        times = []
        for _ in range(iters):
            start = clock()
            layer(*inputs)
            times.append(clock() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="turns of each mode per case (A B B A ..)")
    parser.add_argument("--iters", type=int, default=5, help="timed layer calls per turn")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="this process's CPU time, or wall")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = getattr(torch, args.dtype)
    num_blocks = 32 * 1024 // BLOCK + 64
    layer = make_layer(num_blocks, dtype)
    print(f"| case ({args.dtype}, {args.threads} thread(s), {args.clock} clock) | absorbed ms | decompressed ms | "
          "absorbed / decompressed |\n| --- | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(2)
    for label, num_seqs, new_tokens, context_len in CASES:
        tokens = num_seqs * new_tokens
        inputs = tuple(torch.randn(shape, generator=gen).to(dtype) for shape in
                       ((tokens, HEADS, NOPE), (tokens, HEADS, ROPE), (tokens, LATENT), (tokens, ROPE)))
        context = make_context(num_seqs, new_tokens, context_len, num_blocks)
        runs: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                runs[mode].append(time_case(layer, mode, context, inputs, args.iters, clock))
        absorbed, decompressed = (statistics.median(runs[mode]) * 1e3 for mode in MODES)
        print(f"| {label} | {absorbed:.2f} | {decompressed:.2f} | {absorbed / decompressed:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
