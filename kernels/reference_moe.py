"""Pure-torch grouped GEMM for mixture-of-experts layers: the reference of
kernels/triton_grouped_gemm.py (same signature) and the CPU implementation.

Rows of `a` come sorted by expert: expert e owns rows [group_ends[e - 1], group_ends[e]) (0 for e = 0),
and each row is multiplied by its expert's weight, stored like a Linear's ([out, in]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_gemm(
    a: torch.Tensor,  # [M, K], rows sorted by expert
    b: torch.Tensor,  # [E, N, K], one [out, in] weight per expert
    group_ends: torch.Tensor,  # [E] int32, cumulative row counts: expert e ends at row group_ends[e]
) -> torch.Tensor:  # [M, N]: row i times the weight of the expert that owns it
    """One batched product per expert group, no Python loop over rows."""
    if a.shape[0] == 0:
        return a.new_empty(0, b.shape[1])
    if _grouped_mm_fits(a, b):
        return F.grouped_mm(a, b.transpose(1, 2), offs=group_ends.to(torch.int32))
    return _expert_loop(a, b, group_ends)


def _grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch's grouped_mm needs every row stride to be a multiple of 16 bytes."""
    if not hasattr(F, "grouped_mm") or a.dtype != b.dtype:
        return False
    row_bytes = {a.shape[1] * a.element_size(), b.shape[1] * b.element_size(), b.shape[2] * b.element_size()}
    return a.is_contiguous() and b.is_contiguous() and all(size % 16 == 0 for size in row_bytes)


def _expert_loop(a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """Shapes grouped_mm refuses: one product per expert that owns rows (never one per row)."""
    out = a.new_empty(a.shape[0], b.shape[1])
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            torch.matmul(a[start:end], b[expert].t(), out=out[start:end])
        start = end
    return out
