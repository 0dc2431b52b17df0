"""Offline throughput of a tiny random-weight MoE model: pdserve's engine against transformers'
generate(), batch 32 and 1, in one process (experiments/offline_throughput.py's two runners).

    python experiments/moe_offline_throughput.py [--arch qwen3-moe|qwen2-moe|mixtral|deepseek-v3] [--size tiny|small]
                                                 [--batch 32 --batch 1]
                                                 [--prompt-len 128] [--new-tokens 64] [--repeats 3] [--expert-loop]
                                                 [--unpacked-experts] [--threads N]

Each figure is the median of --repeats runs taken in turns (A B B A ...: experiments/ab_runs.py), so a
shared machine that drifts weighs on both engines alike; "spread" is the lowest and highest ratio of the
runs paired in turn (pdserve's i-th run over transformers' i-th), the run-to-run noise to read the median against.
--threads sets torch's intra-op threads for both engines (default: torch's own).

The model is built here with transformers' own config class and save_pretrained (the hub's
per-expert checkpoint format), with the demo tokenizer. --expert-loop adds a pdserve column whose
CPU experts run one product per expert instead of torch's grouped_mm (the two CPU paths of
kernels/reference_moe.py), to measure which is faster here. --unpacked-experts (with --dtype bfloat16) adds a
pdserve column whose experts are not packed for pdserve's bf16 CPU kernel (kernels/cpu_grouped_gemm.py) and stay on
kernels/reference_moe.py; it runs beside each pdserve run, first in every other turn, and "packed/unpacked" is the
median of the runs paired in turn, with their lowest and highest ratio.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
import transformers

import statistics

from ab_runs import mode_order
from offline_throughput import make_prompts, run_pdserve, run_transformers

_SPECIAL = {"vocab_size": 1024, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
# tiny: the parity tests' shape; small: wide enough that the experts' products, not per-step overheads, dominate
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "moe_scale": 1},
    "small": {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "moe_scale": 8},
}
ARCHS = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "head_dim": 32}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # MLA (latent 32 + rope 16) and 8 experts in 4 groups, top-2 of the best 2 groups, a shared expert
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "moe_intermediate_size": 32, "kv_lora_rank": 32, "q_lora_rank": 48,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 24, "v_head_dim": 20, "num_key_value_heads": None}),
}


def build_model(arch: str, size: str, out_dir: Path) -> str:
    """The demo tokenizer's files, then the MoE model's config and weights written over the demo's."""
    from pdserve.demo_model import make_demo_model

    make_demo_model(out_dir, arch="llama", size="tiny")
    config_class, architecture, fields = ARCHS[arch]
    shape = dict(SIZES[size])
    scale = shape.pop("moe_scale")  # expert sizes grow with the model
    fields = {k: v * scale if k.endswith("intermediate_size") else v for k, v in fields.items()}
    if "head_dim" in fields:
        fields["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"] * 2
    config = getattr(transformers, config_class)(**{**_SPECIAL, **shape, **fields})
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.1)
            else:  # [out, in] or [experts, out, in]
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
    model.save_pretrained(out_dir)
    return str(out_dir)


def run_pdserve_expert_loop(model_dir: str, prompts, batch: int, new_tokens: int, dtype: str) -> float:
    from pdserve.kernels import reference_moe

    fits = reference_moe._grouped_mm_fits
    reference_moe._grouped_mm_fits = lambda a, b: False  # every shape takes the per-expert loop
    try:
        return run_pdserve(model_dir, prompts, batch, new_tokens, dtype)
    finally:
        reference_moe._grouped_mm_fits = fits


def run_pdserve_unpacked(model_dir: str, prompts, batch: int, new_tokens: int, dtype: str) -> float:
    from pdserve.engine.layers.moe import ExpertWeights

    pack = ExpertWeights.pack_for_cpu
    ExpertWeights.pack_for_cpu = lambda self: False  # the experts stay stacked, on kernels/reference_moe.py
    try:
        return run_pdserve(model_dir, prompts, batch, new_tokens, dtype)
    finally:
        ExpertWeights.pack_for_cpu = pack


def pdserve_turn(args: argparse.Namespace, turn: int) -> list[str]:
    """The pdserve runs of one turn: packed and unpacked swap places every other turn."""
    names = ["pdserve", "unpacked"] if args.unpacked_experts else ["pdserve"]
    return (names if turn % 2 == 0 else names[::-1]) + (["loop"] if args.expert_loop else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=list(ARCHS), default="qwen3-moe")
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default: 32 and 1)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine, in turns; medians reported")
    parser.add_argument("--expert-loop", action="store_true", help="also pdserve with one product per expert")
    parser.add_argument("--unpacked-experts", action="store_true",
                        help="also pdserve with its bf16 experts not packed for pdserve's CPU kernel")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads, both engines")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = build_model(args.arch, args.size, Path(tempfile.mkdtemp(prefix=f"moe-{args.arch}-")))
    print(f"{args.arch} ({args.size}, random weights) {model_dir}; {args.dtype}; torch threads {torch.get_num_threads()}")
    loop_header = f" {'loop tok/s':>11} {'loop/grouped':>12}" if args.expert_loop else ""
    unpacked_header = f" {'unpacked tok/s':>15} {'packed/unpacked':>15} {'spread':>11}" if args.unpacked_experts else ""
    print(f"{'batch':>5} {'transformers tok/s':>19} {'pdserve tok/s':>14} {'ratio':>6} {'spread':>11}{loop_header}"
          f"{unpacked_header}")
    runners = {"transformers": run_transformers, "pdserve": run_pdserve, "loop": run_pdserve_expert_loop,
               "unpacked": run_pdserve_unpacked}
    for batch in args.batch or [32, 1]:
        prompts = make_prompts(max(batch, 4), args.prompt_len, _SPECIAL["vocab_size"])
        runs: dict[str, list[float]] = {name: [] for name in runners}
        for mode in mode_order(("transformers", "pdserve"), args.repeats):
            for name in pdserve_turn(args, len(runs["pdserve"])) if mode == "pdserve" else [mode]:
                runs[name].append(runners[name](model_dir, prompts, batch, args.new_tokens, args.dtype))
        theirs, ours = statistics.median(runs["transformers"]), statistics.median(runs["pdserve"])
        paired = [o / t for o, t in zip(runs["pdserve"], runs["transformers"])]
        spread = f"{min(paired):.2f}-{max(paired):.2f}"
        line = f"{batch:>5} {theirs:>19.1f} {ours:>14.1f} {ours / theirs:>6.2f} {spread:>11}"
        if args.expert_loop:
            loop = statistics.median(runs["loop"])
            line += f" {loop:>11.1f} {loop / ours:>12.2f}"
        if args.unpacked_experts:
            packed_paired = [p / u for p, u in zip(runs["pdserve"], runs["unpacked"])]
            packed_spread = f"{min(packed_paired):.2f}-{max(packed_paired):.2f}"
            line += (f" {statistics.median(runs['unpacked']):>15.1f} {statistics.median(packed_paired):>15.2f}"
                     f" {packed_spread:>11}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
