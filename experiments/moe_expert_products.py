"""pdserve's routed experts in bf16 alone, packed for pdserve's CPU kernel (kernels/cpu_grouped_gemm.py) against
unpacked (kernels/reference_moe.py), in turns in one process, at the expert shapes moe_offline_throughput.py builds.

    python experiments/moe_expert_products.py [--turns 11] [--threads 1]

Each figure is the median of --turns timings per mode (packed and unpacked swap places every turn); the spread is
the lowest and highest unpacked / packed ratio of the timings paired in turn.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.engine.layers.moe import ExpertWeights, select_experts

SHAPES = {  # (experts, hidden, expert intermediate, top-k): moe_offline_throughput.py's tiny and small
    "mixtral tiny": (4, 64, 128, 2), "qwen3-moe tiny": (8, 64, 32, 2),
    "mixtral small": (4, 512, 1024, 2), "qwen3-moe small": (8, 512, 256, 2),
}
TOKENS = (1, 32, 128, 4096)  # decode at batch 1 and 32, one prefill, the batch-32 prefill


def expert_pair(num_experts: int, hidden: int, intermediate: int) -> tuple[ExpertWeights, ExpertWeights]:
    """The same random bf16 experts twice: unpacked, and packed for the kernel."""
    torch.manual_seed(0)
    plain, packed = (ExpertWeights(num_experts, hidden, intermediate).to(torch.bfloat16) for _ in range(2))
    for module in (plain, packed):
        module.gate_up_proj.data.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
        module.down_proj.data.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
    if not packed.pack_for_cpu():
        raise SystemExit("pdserve's bf16 CPU kernel does not run here (kernels/cpu_gemm.py unavailable_reason)")
    return plain, packed


def mean_us(run, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'shape':>16} {'tokens':>6} {'unpacked us':>12} {'packed us':>10} {'unpacked/packed':>15} {'spread':>11}")
    for name, (num_experts, hidden_size, intermediate, top_k) in SHAPES.items():
        plain, packed = expert_pair(num_experts, hidden_size, intermediate)
        for tokens in TOKENS:
            hidden = torch.randn(tokens, hidden_size, dtype=torch.bfloat16)
            weights, ids = select_experts(torch.randn(tokens, num_experts), top_k, renormalize=True)
            repeats = max(3, (20_000 if hidden_size < 512 else 2_000) // tokens)
            times: dict[str, list[float]] = {"plain": [], "packed": []}
            with torch.inference_mode():
                for turn in range(args.turns):
                    for mode, module in [("plain", plain), ("packed", packed)][::1 if turn % 2 == 0 else -1]:
                        times[mode].append(mean_us(lambda: module(hidden, weights, ids), repeats))
            ratios = [p / q for p, q in zip(times["plain"], times["packed"])]
            print(f"{name:>16} {tokens:>6} {statistics.median(times['plain']):>12.1f} "
                  f"{statistics.median(times['packed']):>10.1f} {statistics.median(ratios):>15.2f} "
                  f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>11}", flush=True)


if __name__ == "__main__":
    main()
