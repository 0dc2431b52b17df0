"""The Llama family decoder (Llama, Mistral, Qwen2, Qwen3): one implementation, explicit per-architecture flags.

Weights load under Hugging Face names; q/k/v and gate/up are fused into one projection each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.attention import Attention
from pdserve.engine.layers.linear import Linear, MergedLinear, default_weight_loader
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, Rotation
from pdserve.kernels.cpu_norm_rotary import silu_and_mul


@dataclass(frozen=True)
class ArchFlags:
    qkv_bias: bool = False  # Qwen2 always has q/k/v biases, whatever config.json says
    qk_norm: bool = False  # Qwen3 RMS-normalises each head of q and k before rotary


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, flags: ArchFlags, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = flags.qkv_bias or config.attention_bias
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags.qk_norm else None
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                              sliding_window=config.sliding_window_of(layer_idx))

    def forward(self, rotation: Rotation, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation(q, k)
        return self.o_proj(self.attn(q, k, v))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {0: size, 1: size}, bias=config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, 2I] (gate | up) -> [T, I]


class DecoderLayer(nn.Module):
    """Pre-norm attention then feed-forward, each family bringing its attention (called
    attn(rotation, hidden)) and its MLP."""

    def __init__(self, config: ModelConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn  # DecoderAttention, or DeepSeek's latent attention
        self.mlp = mlp  # GatedMLP, or a mixture of experts (engine/layers/moe.py)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rotation: Rotation, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotation, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderStack(nn.Module):
    """Embedding, one cos/sin table looked up once per step for every layer, the decoder layers, the final norm.
    Each model family brings its own layers (called layer(rotation, hidden, residual))."""

    def __init__(self, config: ModelConfig, rope_dim: int, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_tokens.weight.weight_loader = default_weight_loader
        self.rotary_emb = RotaryEmbedding(rope_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # (hidden, rotation) -> (last layer's output, residual) for a decode step it takes in one call, else None:
        # engine/models/cpu_decode_layers.py, bound by the CPU attention backend where the model allows it
        self.native_decode: Callable[[torch.Tensor, Rotation], tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        rotation = self.rotary_emb(positions, hidden.dtype)
        done = None if self.native_decode is None else self.native_decode(hidden, rotation)
        if done is not None:
            hidden, residual = done
        else:
            for layer in self.layers:
                hidden, residual = layer(rotation, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderModel(DecoderStack):
    def __init__(self, config: ModelConfig, flags: ArchFlags,
                 make_mlp: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__(config, config.head_dim,
                         (DecoderLayer(config, DecoderAttention(config, flags, i), make_mlp(config, i))
                          for i in range(config.num_layers)))


class DecoderForCausalLM(nn.Module):
    """A DecoderStack (`model`) and its lm_head, tied to the embedding when the config says so."""

    def __init__(self, config: ModelConfig, model: DecoderStack) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab] (float32)."""
        return self.lm_head(hidden).float()


class LlamaForCausalLM(DecoderForCausalLM):
    flags = ArchFlags()
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderModel(config, self.flags, self.make_mlp))

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The feed-forward block of one layer (mixture-of-experts models override it)."""
        return GatedMLP(config)

    def bind_kv_cache(self, kv_cache: torch.Tensor, attn_backend: AttentionBackend) -> None:
        """kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
        for layer_idx, layer in enumerate(self.model.layers):
            layer.self_attn.attn.bind_kv_cache(kv_cache[layer_idx, 0], kv_cache[layer_idx, 1], attn_backend)


class MistralForCausalLM(LlamaForCausalLM):
    flags = ArchFlags()


class Qwen2ForCausalLM(LlamaForCausalLM):
    flags = ArchFlags(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    flags = ArchFlags(qk_norm=True)
