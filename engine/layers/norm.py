"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pdserve.engine.layers.linear import default_weight_loader
from pdserve.kernels import reference_extra

# (x, residual or None, weight, eps) -> (norm(x + residual), x + residual), like kernels.reference_extra
NormKernel = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        # torch, computed in float32 like transformers and cast back before the weight multiply
        self.kernel: NormKernel = reference_extra.add_rms_norm

    def use_kernel(self, kernel: NormKernel) -> None:
        """Normalise with `kernel` from now on (the attention backend's fused kernel, bound once)."""
        self.kernel = kernel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (or [T, heads, head_dim] for q/k norms). With a residual, returns
        (norm(x + residual), x + residual)."""
        normed, summed = self.kernel(x, residual, self.weight, self.eps)
        return normed if residual is None else (normed, summed)
