"""Triton fused residual add + RMSNorm: one read of hidden and residual, one write of each result."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES, check_devices, check_last_dim_contiguous, check_same_dtype, check_shape, check_tensor,
)
from pdserve.kernels.triton_utils import next_pow2


@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    eps,
    stride_hidden, stride_residual, stride_out, stride_new_residual,
    HIDDEN_SIZE: tl.constexpr, HIDDEN_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    # One program per token row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HIDDEN_PAD)
    mask = cols < HIDDEN_SIZE
    x = tl.load(hidden_ptr + row * stride_hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    summed = x.to(new_residual_ptr.dtype.element_ty)  # the residual stream keeps the model dtype
    tl.store(new_residual_ptr + row * stride_new_residual + cols, summed, mask=mask)

    x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HIDDEN_SIZE + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)  # cast back before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm_args(hidden, residual, weight, eps) -> None:
    check_tensor("hidden", hidden, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    check_shape("weight", weight, (hidden.shape[1],), "[hidden_size]")
    names, tensors = ("hidden", "weight"), (hidden, weight)
    if residual is not None:
        check_tensor("residual", residual, 2, FLOAT_DTYPES)
        check_shape("residual", residual, tuple(hidden.shape), "same as hidden")
        names, tensors = names + ("residual",), tensors + (residual,)
    check_same_dtype(names, tensors)
    for name, tensor in zip(names, tensors, strict=True):
        check_last_dim_contiguous(name, tensor)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise ValueError(f"eps must be a Python float, got {type(eps).__name__}")
    check_devices(names, tensors)


def launch_add_rms_norm(
    hidden: torch.Tensor,  # [T, hidden_size]
    residual: torch.Tensor | None,  # [T, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    out: torch.Tensor,  # [T, hidden_size], written
    new_residual: torch.Tensor,  # [T, hidden_size], written (may be `residual` itself: in place)
) -> None:
    num_tokens, hidden_size = hidden.shape
    for name, tensor in (("out", out), ("new_residual", new_residual)):
        check_shape(name, tensor, tuple(hidden.shape), "same as hidden")
        check_last_dim_contiguous(name, tensor)
    if num_tokens == 0:
        return
    has_residual = residual is not None
    residual_arg = residual if has_residual else hidden
    _add_rms_norm_kernel[(num_tokens,)](
        hidden, residual_arg, weight, out, new_residual,
        float(eps),
        hidden.stride(0), residual_arg.stride(0), out.stride(0), new_residual.stride(0),
        HIDDEN_SIZE=hidden_size, HIDDEN_PAD=next_pow2(hidden_size), HAS_RESIDUAL=has_residual,
        num_warps=8 if hidden_size >= 4096 else 4,
    )


def add_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of kernels.reference_extra.add_rms_norm (arguments, shapes and result as there)."""
    _check_norm_args(hidden, residual, weight, eps)
    out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    new_residual = torch.empty_like(out)
    launch_add_rms_norm(hidden, residual, weight, eps, out, new_residual)
    return out, new_residual
