"""Tiny random-weight DeepSeek-V3 (and V2) model directories made by transformers' own config classes and
save_pretrained (the hub's per-expert checkpoint format), with the demo tokenizer's files."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.engine.moe_models import VOCAB_SIZE, init_random, save_random_model

# 3 layers (layer 0 dense), 4 heads, latent 32 + rope 16 per token, 8 experts in 4 groups (2 groups
# searched), top-2 renormalised and scaled by 2.5, one shared expert; nope 24 != v 20.
DEEPSEEK_V3_SHAPE = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 32, "q_lora_rank": 48,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 24, "v_head_dim": 20, "max_position_embeddings": 1024,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}
# case -> what differs from DEEPSEEK_V3_SHAPE
DEEPSEEK_CASES = {
    "deepseek-v3": {},
    # q through one q_proj, rope pairs as halves, no renormalisation, a linear rope scaling with
    # mscale_all_dim (the softmax scale grows by mscale^2)
    "deepseek-v3-plain-q": {
        "q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
    },
    # every expert routed to every token: bf16 rounding cannot swap an expert (a swap moves a token's output by
    # a whole expert's share, beyond any rounding rule); the weights, scaling and shared expert still count
    "deepseek-v3-all-experts": {"num_experts_per_tok": 8, "topk_group": 4},
    # YaRN as DeepSeek-V3's release uses it, pretrained on 32 positions and stretched 4x (prompts reach 79):
    # mscale != mscale_all_dim, so cos/sin carry an attention factor (1.012) and the softmax scale mscale^2 (1.265)
    "deepseek-v3-yarn": {
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.9,
                            "rope_theta": 10000.0},
    },
}


# DeepSeek-V2 (same shape): softmax routing, top-2 of all experts (greedy), or of the best 2 of 4 groups by
# their best expert (group_limited_greedy); no renormalisation, no correction bias
DEEPSEEK_V2_CASES = {
    "deepseek-v2-greedy": {"topk_method": "greedy"},
    "deepseek-v2-group-limited": {"topk_method": "group_limited_greedy", "q_lora_rank": None},
}


def make_deepseek_model_dir(out_dir: Path, tokenizer_dir: str, dtype: str = "float32", version: int = 3,
                            **overrides) -> str:
    """A DeepSeek-V3 (or, with version=2, DeepSeek-V2) model dir of DEEPSEEK_V3_SHAPE with `overrides`."""
    config = getattr(transformers, f"DeepseekV{version}Config")(**{**DEEPSEEK_V3_SHAPE, **overrides})
    return save_random_model(out_dir, config, f"DeepseekV{version}ForCausalLM", tokenizer_dir, _init_deepseek, dtype)


def _init_deepseek(model: torch.nn.Module) -> None:
    init_random(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero by default: make it choose
                buffer.normal_(0.0, 0.05)
