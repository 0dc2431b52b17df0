"""Rotary position embedding (rotate-halves layout) with precomputed cos/sin tables.

Supported scalings: default, linear, llama3. Others raise a clear error at start-up.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.forward_context import get_forward_context

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedRopeError(ValueError):
    pass


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:  # [head_dim // 2]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = _base_inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise UnsupportedRopeError(
        f"rope scaling type {rope_type!r} is not supported by pdserve yet (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint without it or --model-impl transformers"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        # [max_positions, head_dim]: cos | sin, the layout the Triton rotary kernel reads too
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kernels.kernel_backend(query.device) == "triton":  # one fused kernel gathers and rotates
            return kernels.rotary_embedding(positions, query, key, self.cos_sin_cache)
        # the same for every layer of the step: looked up once
        cos, sin = get_forward_context().cached(("rotary", id(self), query.dtype),
                                                lambda: self._cos_sin(positions, query.dtype))
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions)[:, None, :].to(dtype)  # [T, 1, head_dim]
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, 1, head_dim // 2] each
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
