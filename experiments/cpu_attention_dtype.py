"""CPU paged attention in float32 against bfloat16, through the engine's torch-paged backend.

    python experiments/cpu_attention_dtype.py [--repeats 7] [--layers 8] [--threads N] [--clock wall|cpu]
                                              [--against REV]

Times what a step's attention costs on CPU at the demo model's shapes (9 heads, 3 KV heads, head_dim 64,
block size 16): the backend's prepare (plans) once per step, then `--layers` layers of gather +
attention, for decode batches 1/8/32 at contexts 256/1024 and one 1,000-token prefill. fp32 and bf16
runs alternate, so both see the same machine load; each line gives the medians per layer and the
bf16/fp32 ratio of the same run (below 1: bf16 is faster). The blocks of each sequence are scattered
over the cache (a shuffled block pool), as a serving engine's are after some traffic. On a loaded
machine, `--threads 1 --clock cpu` (this process's CPU time) is steadier than the wall clock.
`--against REV` times decode only, this tree's kernels/torch_paged.py against the one at git revision REV
(plan once per step, then the layers), the two alternating, per dtype; the last column is REV / this tree.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from pdserve.engine.attention.torch_paged import TorchPagedBackend
from pdserve.engine.forward_context import ForwardContext
from pdserve.kernels import torch_paged

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DECODE_SHAPES = [(batch, context) for context in (256, 1024) for batch in (1, 8, 32)]
PREFILL_TOKENS = 1000


def make_layer(num_blocks: int, dtype: torch.dtype, seed: int = 0) -> SimpleNamespace:
    """What the backend reads off an Attention layer: its caches and its options."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return SimpleNamespace(key_cache=torch.randn(shape, generator=gen).to(dtype),
                           value_cache=torch.randn(shape, generator=gen).to(dtype),
                           scale=HEAD_DIM ** -0.5, sliding_window=None, soft_cap=None, sinks=None)


def block_tables(num_seqs: int, context: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    per_seq = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return pool[:num_seqs * per_seq].view(num_seqs, per_seq).int()  # [S, blocks]


def decode_context(batch: int, context: int, num_blocks: int) -> ForwardContext:
    empty = torch.zeros(0, 1, dtype=torch.int32)
    return ForwardContext(
        slot_mapping=torch.zeros(batch, dtype=torch.int64), num_decode_tokens=batch,
        decode_block_tables=block_tables(batch, context, num_blocks),
        decode_seq_lens=torch.full((batch,), context, dtype=torch.int32),
        prefill_block_tables=empty, prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32))


def prefill_context(tokens: int, num_blocks: int) -> ForwardContext:
    return ForwardContext(
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32), decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=block_tables(1, tokens, num_blocks),
        prefill_query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([tokens], dtype=torch.int32))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def time_step(backend: TorchPagedBackend, context: ForwardContext, layer: SimpleNamespace, query: torch.Tensor,
              layers: int, decode: bool) -> float:
    """Seconds per layer: one prepare (the plans are built by the first layer), then `layers` layers."""
    started = clock()
    metadata = backend.prepare(context)
    for _ in range(layers):
        if decode:
            backend.forward_decode(query, layer, metadata)
        else:
            backend.forward_prefill(query, layer, metadata)
    return (clock() - started) / layers


def compare(label: str, context: ForwardContext, num_tokens: int, num_blocks: int, decode: bool,
            args: argparse.Namespace) -> tuple[float, float]:
    backend = TorchPagedBackend(BLOCK_SIZE)
    setups = {}
    for dtype in (torch.float32, torch.bfloat16):
        query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
        setups[dtype] = (make_layer(num_blocks, dtype), query)
        time_step(backend, context, *setups[dtype], 1, decode)  # warm-up
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    for _ in range(args.repeats):
        for dtype in (torch.float32, torch.bfloat16):  # alternate: the same load for both
            times[dtype].append(time_step(backend, context, *setups[dtype], args.layers, decode))
    fp32, bf16 = (statistics.median(times[d]) * 1e3 for d in (torch.float32, torch.bfloat16))
    print(f"| {label} | {fp32:.3f} | {bf16:.3f} | {bf16 / fp32:.2f} |", flush=True)
    return fp32, bf16


def load_revision(rev: str) -> ModuleType:
    """kernels/torch_paged.py as it is at git revision `rev`, as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:kernels/torch_paged.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    module = ModuleType(f"torch_paged_at_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:kernels/torch_paged.py", "exec"), module.__dict__)
    return module


def time_decode(kernels: ModuleType, context: ForwardContext, layer: SimpleNamespace, query: torch.Tensor,
                layers: int) -> float:
    """Seconds per layer of kernels' decode: one plan, then `layers` layers."""
    started = clock()
    plan = kernels.plan_decode(context.decode_block_tables, context.decode_seq_lens, BLOCK_SIZE)
    for _ in range(layers):
        kernels.decode_attention_planned(query, layer.key_cache, layer.value_cache, plan, layer.scale)
    return (clock() - started) / layers


def compare_revisions(rev: str, args: argparse.Namespace) -> None:
    kernels = {rev: load_revision(rev), "this tree": torch_paged}
    print(f"| shape | dtype | {rev} ms/layer | this tree ms/layer | {rev} / this tree |\n| --- | --- | --- | --- | --- |")
    for batch, context_len in DECODE_SHAPES:
        num_blocks = 2 * batch * context_len // BLOCK_SIZE + 8
        context = decode_context(batch, context_len, num_blocks)
        for dtype in (torch.float32, torch.bfloat16):
            layer = make_layer(num_blocks, dtype)
            query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for name, module in kernels.items():
                time_decode(module, context, layer, query, 1)  # warm-up
            for _ in range(args.repeats):
                for name, module in kernels.items():  # alternate: the same load for both
                    times[name].append(time_decode(module, context, layer, query, args.layers))
            old, new = (statistics.median(times[name]) * 1e3 for name in kernels)
            print(f"| decode batch {batch}, context {context_len} | {str(dtype).removeprefix('torch.')} | "
                  f"{old:.3f} | {new:.3f} | {old / new:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per dtype and shape")
    parser.add_argument("--layers", type=int, default=8, help="layers per step (one plan per step)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (use with --threads 1)")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="decode only: this tree's kernels/torch_paged.py against the one at git revision REV")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if args.against:
        compare_revisions(args.against, args)
        return
    print("| shape | fp32 ms/layer | bf16 ms/layer | bf16 / fp32 |\n| --- | --- | --- | --- |")
    for batch, context in DECODE_SHAPES:
        num_blocks = 2 * batch * context // BLOCK_SIZE + 8
        compare(f"decode batch {batch}, context {context}", decode_context(batch, context, num_blocks), batch,
                num_blocks, True, args)
    num_blocks = 2 * PREFILL_TOKENS // BLOCK_SIZE + 8
    compare(f"prefill {PREFILL_TOKENS} tokens", prefill_context(PREFILL_TOKENS, num_blocks), PREFILL_TOKENS,
            num_blocks, False, args)


if __name__ == "__main__":
    main()
