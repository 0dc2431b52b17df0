"""The machine bound of offline_throughput.py's run (and of `pdserve bench`'s load of the same shape): the time the
model's linears alone need for it, the prompts' prefill then one decode step per new token, on this host's cores.

    python experiments/offline_bound.py [--dtype bfloat16] [--batch 32 --batch 1] [--prompt-len 128] [--new-tokens 64]

Each linear of the demo model (or --model) is timed at the run's row counts, two ways: as pdserve runs it
(prepacked: pdserve's bf16 kernel or oneDNN) and plain F.linear (what transformers runs). Each is timed on one
thread in this thread's CPU seconds, the fastest of --repeats tries, weights warm in cache, so a busy host inflates
it least; the run divides that by --cores (perfect scaling). A decode step cannot beat its weights' trip from
memory either: each step is priced at the larger of its in-cache compute and its weight bytes over the read
bandwidth all --cores threads reach (measured here: a sum over a 1 GiB buffer). Prompts are priced at their
in-cache compute (the GEMM peak: their weights are read once per chunk of hundreds of rows). Nothing but the
linears is counted: no engine on those cores can finish the run faster.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from pdserve.engine.layers.linear import Linear


def layer_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears, q|k|v and gate|up fused as pdserve runs them."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return [(config.hidden_size, q + 2 * kv), (q, config.hidden_size),
            (config.hidden_size, 2 * config.intermediate_size), (config.intermediate_size, config.hidden_size)]


def fastest(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        fn()
        best = min(best, time.thread_time() - started)
    return best


def linear_seconds(in_f: int, out_f: int, rows: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(prepacked oneDNN, plain F.linear) seconds for one [rows, in_f] x [in_f, out_f] product."""
    linear = Linear(in_f, out_f).to(dtype)
    torch.nn.init.normal_(linear.weight, std=0.02)
    weight = linear.weight.detach().clone()
    x = torch.randn(rows, in_f).to(dtype)
    plain = fastest(lambda: F.linear(x, weight), repeats)
    packed = fastest(lambda: linear(x), repeats) if linear.pack_for_cpu(keep_weight=False) else plain
    return packed, plain


def read_bandwidth(threads: int, repeats: int) -> float:
    """Bytes a second that `threads` threads read from memory: the fastest sum over a 1 GiB float32 buffer."""
    buffer = torch.ones(1 << 28)  # 1 GiB: far past every cache
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return buffer.numel() * buffer.element_size() / best


def weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads: every layer's linears and the lm_head."""
    elements = sum(in_f * out_f for in_f, out_f in layer_shapes(config)) * config.num_layers
    elements += config.hidden_size * config.vocab_size
    return elements * torch.empty((), dtype=dtype).element_size()


def run_parts(config, batch: int, prompt_len: int, dtype: torch.dtype,
              repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((prepacked, plain) GEMM seconds of the prompts' prefill, (prepacked, plain) of one decode step); the lm_head
    runs once per sequence: on its prompt's last position, then once per decode step."""
    prefill, step = [0.0, 0.0], [0.0, 0.0]
    for totals, rows in ((prefill, batch * prompt_len), (step, batch)):
        for in_f, out_f in layer_shapes(config):
            for i, seconds in enumerate(linear_seconds(in_f, out_f, rows, dtype, repeats)):
                totals[i] += seconds * config.num_layers
    for i, seconds in enumerate(linear_seconds(config.hidden_size, config.vocab_size, batch, dtype, repeats)):
        prefill[i] += seconds
        step[i] += seconds
    return (prefill[0], prefill[1]), (step[0], step[1])


def bound_seconds(prefill_s: float, step_s: float, new_tokens: int, cores: int, stream_s: float) -> float:
    """The run's bound: the prefill (the first new token) over the cores, then new_tokens - 1 decode steps, each the
    larger of its compute over the cores and its weights' stream."""
    return prefill_s / cores + (new_tokens - 1) * max(step_s / cores, stream_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the SmolLM-135M-shaped demo model)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default: 32 and 1)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores the run may use")
    args = parser.parse_args()
    if args.model is None:
        from pdserve.demo_model import default_demo_model

        args.model = str(default_demo_model("llama", "small"))
    from pdserve.engine.config import ModelConfig

    config = ModelConfig.from_hf(args.model)
    dtype = getattr(torch, args.dtype)
    bandwidth = read_bandwidth(args.cores, args.repeats)
    stream_s = weight_bytes(config, dtype) / bandwidth
    torch.set_num_threads(1)
    print(f"model {args.model}; {args.dtype}; one thread's CPU seconds / {args.cores} cores; a step's weights "
          f"{weight_bytes(config, dtype) / 1e6:.0f} MB at {bandwidth / 2**30:.1f} GiB/s read = {stream_s * 1e3:.1f} ms")
    print(f"{'batch':>5} {'prefill s':>9} {'step ms':>8} {'bound s':>8} {'tok/s bound':>11} {'plain: prefill s':>16} "
          f"{'step ms':>8} {'bound s':>8} {'tok/s bound':>11}")
    for batch in args.batch or [32, 1]:
        tokens = batch * args.new_tokens
        cells = []
        for prefill_s, step_s in zip(*run_parts(config, batch, args.prompt_len, dtype, args.repeats), strict=True):
            bound = bound_seconds(prefill_s, step_s, args.new_tokens, args.cores, stream_s)
            cells.append(f"{prefill_s / args.cores:>9.2f} {step_s / args.cores * 1e3:>8.1f} {bound:>8.2f} "
                         f"{tokens / bound:>11.1f}")
        print(f"{batch:>5} {cells[0]} {cells[1]:>16}")

if __name__ == "__main__":
    main()
