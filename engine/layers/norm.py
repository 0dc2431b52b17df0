"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 like transformers, then cast back before the weight multiply.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (or [T, heads, head_dim] for q/k norms). With a residual, returns
        (norm(x + residual), x + residual)."""
        if x.dim() == 2 and kernels.kernel_backend(x.device) == "triton":  # fused add + norm, one pass
            normed, summed = kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, summed)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed
