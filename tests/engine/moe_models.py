"""Tiny random-weight MoE model directories (Mixtral, Qwen2-MoE, Qwen3-MoE) made by transformers'
own config classes and save_pretrained, which writes the hub's per-expert checkpoint format."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
import transformers

VOCAB_SIZE = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_SHAPE = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}

# case -> (config class, architecture, what makes it differ)
MOE_CASES = {
    # 4 experts, top-2, softmax then top-k renormalised, hub names block_sparse_moe.experts.N.w1/w2/w3
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # top-3 of 6 without renormalising, a sigmoid-gated shared expert, layer 1 a dense MLP
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1]}),
    # top-2 of 8 renormalised, q/k norm, head_dim 32 != hidden / heads
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "head_dim": 32}),
}


# Router logits this spread apart leave clear gaps between the k-th and the next expert, so bf16
# rounding (which moves a logit by ~1%) seldom swaps an expert: a swap changes a token's output by a
# whole expert's share, more than any rounding rule can allow.
_ROUTER_STD = 4.0

# MoE architectures without native code: the transformers backend (TransformersMoEForCausalLM)
BACKEND_CASES = {
    # OLMoE: q/k norm over all heads, 4 experts top-2, the qwen2_moe checkpoint conversion in transformers
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
}
# Variants of a MOE_CASES model that one test each covers
VARIANT_CASES = {
    # Qwen2-MoE with its top-k weights renormalised (norm_topk_prob true), which transformers' Qwen2-MoE honours
    "qwen2-moe-norm-topk": (MOE_CASES["qwen2-moe"][0], MOE_CASES["qwen2-moe"][1],
                            {**MOE_CASES["qwen2-moe"][2], "norm_topk_prob": True}),
}
ALL_CASES = {**MOE_CASES, **BACKEND_CASES, **VARIANT_CASES}


def init_random(model: torch.nn.Module) -> None:
    """Non-trivial weights with clear top-1 logit gaps and decisive routers (HF's default init gives
    near-flat logits); expert weights [E, out, in] scaled by their fan-in."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param is head:
                param.normal_(0.0, 4.0 / math.sqrt(param.shape[1]))
            elif param is embed:
                param.normal_(0.0, 0.05)
            elif param.ndim == 1 and "norm" in name:
                param.uniform_(0.5, 1.5)
            elif param.ndim == 1:
                param.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # the router: logits std ~_ROUTER_STD
                param.normal_(0.0, _ROUTER_STD / math.sqrt(param.shape[-1]))
            else:  # [out, in] or [E, out, in]
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))


def save_random_model(out_dir: Path, config, architecture: str, tokenizer_dir: str, init,
                      dtype: str = "float32") -> str:
    """config.json + model.safetensors written by transformers (weights set by `init(model)` under seed 0,
    saved in `dtype`), plus the demo tokenizer's files."""
    config.architectures = [architecture]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        init(model)
    model.to(getattr(torch, dtype)).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    return str(out_dir)


def model_dir_cache(tmp_path_factory, build):
    """make(case, dtype="float32") -> build(out_dir, case, dtype), built once per (case, dtype)."""
    built: dict[tuple[str, str], str] = {}

    def make(case: str, dtype: str = "float32") -> str:
        if (case, dtype) not in built:
            built[case, dtype] = build(tmp_path_factory.mktemp(f"{case}-{dtype}"), case, dtype)
        return built[case, dtype]

    return make


def make_moe_model_dir(out_dir: Path, case: str, tokenizer_dir: str, dtype: str = "float32") -> str:
    """A model dir of one of ALL_CASES."""
    config_class, architecture, fields = ALL_CASES[case]
    config = getattr(transformers, config_class)(**{**_SHAPE, **fields})
    return save_random_model(out_dir, config, architecture, tokenizer_dir, init_random, dtype)
