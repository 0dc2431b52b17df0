"""The GEMM bound of offline_throughput.py's run: the time the model's linears alone take for one run
(prefill of every prompt, then one decode step per new token), on this host's threads.

    python experiments/offline_bound.py [--dtype bfloat16] [--batch 32 --batch 1] [--prompt-len 128] [--new-tokens 64]

Each linear of the demo model (or --model) is timed at the run's row counts, two ways: oneDNN with the
weight prepacked (what pdserve runs) and plain F.linear (what transformers runs). Each is timed on one
thread in this thread's CPU seconds, the fastest of --repeats tries, so a busy host inflates it least;
the run's bound divides that by --cores (perfect scaling). Nothing but the linears is counted: no engine
on those cores can finish the run faster than the prepacked figure.
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


def run_bound(config, batch: int, prompt_len: int, new_tokens: int, dtype: torch.dtype,
              repeats: int) -> tuple[float, float]:
    """(prepacked, plain) GEMM seconds of one run: the prompts' prefill, then new_tokens - 1 decode steps;
    the lm_head runs once per sequence per step."""
    totals = [0.0, 0.0]
    for rows, times in ((batch * prompt_len, 1), (batch, new_tokens - 1)):
        for in_f, out_f in layer_shapes(config):
            for i, seconds in enumerate(linear_seconds(in_f, out_f, rows, dtype, repeats)):
                totals[i] += seconds * config.num_layers * times
    for i, seconds in enumerate(linear_seconds(config.hidden_size, config.vocab_size, batch, dtype, repeats)):
        totals[i] += seconds * new_tokens
    return totals[0], totals[1]


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
    torch.set_num_threads(1)
    print(f"model {args.model}; {args.dtype}; one thread's CPU seconds / {args.cores} cores")
    print(f"{'batch':>5} {'prepacked GEMM s':>17} {'tok/s ceiling':>14} {'plain GEMM s':>13} {'tok/s ceiling':>14}")
    for batch in args.batch or [32, 1]:
        packed, plain = (seconds / args.cores for seconds in
                         run_bound(config, batch, args.prompt_len, args.new_tokens, dtype, args.repeats))
        tokens = batch * args.new_tokens
        print(f"{batch:>5} {packed:>17.2f} {tokens / packed:>14.1f} {plain:>13.2f} {tokens / plain:>14.1f}")


if __name__ == "__main__":
    main()
