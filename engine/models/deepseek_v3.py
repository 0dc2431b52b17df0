"""DeepSeek-V3 (and V2): multi-head latent attention (engine/layers/mla.py) and DeepSeek's mixture of experts.

Attention: the query comes through a low-rank pair (q_a_proj, q_a_layernorm, q_b_proj) or, when
q_lora_rank is null, one q_proj; kv_a_proj_with_mqa gives each token a latent (normalised by
kv_a_layernorm) and a rope key shared by every head, which is all the KV cache keeps. Rotary applies
to the rope parts only; with rope_interleave, their pairs (x0, x1), (x2, x3), .. are rotated, which is
the usual halves rotation after a fixed reordering of q_pe and k_pe (the same for both, so their
products are unchanged).

Feed-forward: the first first_k_dense_replace layers are dense; the others route each token to
num_experts_per_tok of n_routed_experts (engine/layers/moe.py's group-limited routing: V3's sigmoid scores
with a correction bias, or V2's softmax scores) and add n_shared_experts always-on experts.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.layers.linear import Linear, MergedLinear
from pdserve.engine.layers.mla import LatentAttention, LatentUpProjection
from pdserve.engine.layers.moe import ExpertWeights, GroupLimitedRouter
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import Rotation, rope_type_of, supported_rope_types
from pdserve.engine.models.llama import DecoderForCausalLM, DecoderLayer, DecoderStack, GatedMLP


def _field(config: ModelConfig, name: str) -> int:
    value = config.hf_config.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{config.architecture} config.json needs a positive integer `{name}`, got {value!r}")
    return value


def softmax_scale(config: ModelConfig, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale^2 when a rope scaling sets mscale_all_dim (transformers' YaRN
    mscale of factor and mscale_all_dim), as transformers' DeepSeek attention computes it."""
    scale = qk_head_dim ** -0.5
    scaling = config.rope_scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    if rope_type_of(scaling) != "default" and mscale_all_dim:
        from transformers.modeling_rope_utils import yarn_get_mscale

        mscale = yarn_get_mscale(scaling["factor"], mscale_all_dim)
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[.., (x0, x1), (x2, x3), ..] -> [.., x0, x2, .., x1, x3, ..]: interleaved rope pairs as halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hf = config.hf_config
        self.num_heads, self.kv_lora_rank = config.num_heads, config.kv_lora_rank
        self.nope_dim, self.rope_dim = _field(config, "qk_nope_head_dim"), config.qk_rope_head_dim
        self.v_dim = _field(config, "v_head_dim")
        self.interleave = bool(hf.get("rope_interleave", True))
        q_size, bias = self.num_heads * (self.nope_dim + self.rope_dim), config.attention_bias
        latent_size = self.kv_lora_rank + self.rope_dim
        self.q_lora_rank = hf.get("q_lora_rank")
        if self.q_lora_rank:  # hidden -> q_a (rank q_lora_rank) | latent + k_pe, one product
            self.fused_qkv_a_proj = MergedLinear(config.hidden_size, {"q": self.q_lora_rank, "kv": latent_size}, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, q_size)
        else:
            self.q_proj = Linear(config.hidden_size, q_size)
            self.kv_a_proj_with_mqa = Linear(config.hidden_size, latent_size, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = LatentUpProjection(self.kv_lora_rank, self.num_heads, self.nope_dim, self.v_dim)
        self.o_proj = Linear(self.num_heads * self.v_dim, config.hidden_size, bias)
        self.attn = LatentAttention(layer_idx, self.kv_b_proj, self.kv_lora_rank, self.rope_dim,
                                    softmax_scale(config, self.nope_dim + self.rope_dim))

    def forward(self, rotation: Rotation, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.q_lora_rank:
            q_a, latent_kv = self.fused_qkv_a_proj.split(self.fused_qkv_a_proj(hidden))
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q, latent_kv = self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        q_nope, q_pe = q.view(hidden.shape[0], self.num_heads, -1).split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_pe = latent_kv.split((self.kv_lora_rank, self.rope_dim), dim=-1)  # [T, L], [T, R]
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe[:, None, :]  # [T, 1, R]: one rope key for every head
        if self.interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = rotation(q_pe, k_pe)
        return self.o_proj(self.attn(q_nope, q_pe, latent, k_pe[:, 0]))


def _router(config: ModelConfig, sigmoid_routing: bool) -> GroupLimitedRouter:
    """DeepSeek-V3: sigmoid scores with a correction bias, n_group / topk_group, norm_topk_prob. DeepSeek-V2:
    softmax scores, no renormalisation, one group (topk_method greedy) or n_group / topk_group
    (group_limited_greedy)."""
    hf = config.hf_config
    groups, top_groups, renormalize = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1), False
    if sigmoid_routing:
        renormalize = bool(hf.get("norm_topk_prob", True))
    elif hf.get("topk_method", "greedy") == "greedy":
        groups = top_groups = 1
    elif hf.get("topk_method") != "group_limited_greedy":
        raise ConfigError(f"{config.architecture} with topk_method={hf.get('topk_method')!r}: pdserve routes "
                          "DeepSeek-V2 experts with greedy or group_limited_greedy only")
    return GroupLimitedRouter(config.hidden_size, _field(config, "n_routed_experts"),
                              top_k=_field(config, "num_experts_per_tok"), num_groups=groups, top_k_groups=top_groups,
                              renormalize=renormalize, scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                              sigmoid=sigmoid_routing)


class DeepseekV3MoE(nn.Module):
    """Group-limited routed experts plus always-on shared experts (transformers' names: gate, experts,
    shared_experts)."""

    def __init__(self, config: ModelConfig, sigmoid_routing: bool) -> None:
        super().__init__()
        hf = config.hf_config
        num_experts, expert_size = _field(config, "n_routed_experts"), _field(config, "moe_intermediate_size")
        self.gate = _router(config, sigmoid_routing)
        self.experts = ExpertWeights(num_experts, config.hidden_size, expert_size)
        num_shared = int(hf.get("n_shared_experts") or 0)
        self.shared_experts = GatedMLP(config, expert_size * num_shared) if num_shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, expert_ids = self.gate(hidden)
        out = self.experts(hidden, weights, expert_ids)
        if self.shared_experts is not None:
            out += self.shared_experts(hidden)
        return out


def _decoder_layer(config: ModelConfig, layer_idx: int, sigmoid_routing: bool) -> DecoderLayer:
    first_sparse = int(config.hf_config.get("first_k_dense_replace") or 0)
    mlp = DeepseekV3MoE(config, sigmoid_routing) if layer_idx >= first_sparse else GatedMLP(config)
    return DecoderLayer(config, DeepseekV3Attention(config, layer_idx), mlp)


class DeepseekV3Model(DecoderStack):
    def __init__(self, config: ModelConfig, sigmoid_routing: bool) -> None:
        super().__init__(config, config.qk_rope_head_dim,
                         (_decoder_layer(config, i, sigmoid_routing) for i in range(config.num_layers)))


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    sigmoid_routing = True  # DeepSeek-V3's router; False: DeepSeek-V2's (softmax scores, no correction bias)
    # per-expert checkpoint projection name -> which rows of the fused expert weights it fills
    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # released checkpoints add multi-token-prediction layers (model.layers.{num_hidden_layers}..): not served
    skips_layers_past_num_layers = True

    def __init__(self, config: ModelConfig) -> None:
        _check_supported(config)
        super().__init__(config, DeepseekV3Model(config, self.sigmoid_routing))
        # checkpoint name fragment -> (our fused parameter fragment, shard id)
        self.packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        if config.hf_config.get("q_lora_rank"):
            self.packed_modules_mapping.update(q_a_proj=("fused_qkv_a_proj", "q"),
                                               kv_a_proj_with_mqa=("fused_qkv_a_proj", "kv"))

    def bind_kv_cache(self, kv_cache: torch.Tensor, attn_backend: AttentionBackend) -> None:
        """kv_cache [num_layers, 1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]."""
        for layer_idx, layer in enumerate(self.model.layers):
            layer.self_attn.attn.bind_kv_cache(kv_cache[layer_idx, 0])


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: the same MLA (its rope always rotates interleaved pairs) and DeepSeek-V2's routing."""

    sigmoid_routing = False


def _check_supported(config: ModelConfig) -> None:
    """What this implementation does not cover, refused at start with the way out."""
    activation = config.hf_config.get("hidden_act", "silu")
    if activation != "silu":
        raise ConfigError(f"{config.architecture} with hidden_act={activation!r}: pdserve's DeepSeek-V3 code is "
                          "SiLU-gated only")
    rope_type = rope_type_of(config.rope_scaling)
    if rope_type not in supported_rope_types():
        raise ConfigError(f"{config.architecture} with rope scaling {rope_type!r}: pdserve's rotary supports "
                          f"{', '.join(supported_rope_types())} (sequence-dependent types need a table per length); "
                          "use --model-impl transformers")
    if not config.is_mla:
        raise ConfigError(f"{config.architecture} config.json has no kv_lora_rank: it is not an MLA model; restore "
                          "the model directory's config.json")
