"""Pure-torch references (and the CPU implementation) of the optional fused kernels: residual add +
RMSNorm, and neox-style rotary embedding. Same signatures as kernels/triton_norm.py and
kernels/triton_rotary.py.
"""

from __future__ import annotations

import torch


def add_rms_norm(
    hidden: torch.Tensor,  # [T, hidden_size]
    residual: torch.Tensor | None,  # [T, hidden_size], or None for the first layer
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden_size], new residual [T, hidden_size])
    """new_residual = hidden + residual (in hidden's dtype); normed = weight * rmsnorm(new_residual).

    The norm is computed in fp32 and cast back before the weight multiply, like HF's LlamaRMSNorm.
    """
    summed = hidden if residual is None else hidden + residual
    x = summed.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype), summed


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] fp32: cos in the first half, sin in the second
) -> tuple[torch.Tensor, torch.Tensor]:  # (query, key) rotated, new contiguous tensors
    """Neox-style rotary embedding: the first rotary_dim dims of each head are split in halves
    (x1, x2) and rotated to (x1 cos - x2 sin, x2 cos + x1 sin), in fp32; dims past rotary_dim pass
    through unchanged."""
    cos, sin = cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)  # [T, rot/2] each
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1] * 2
    x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)  # [T, H, rot/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
