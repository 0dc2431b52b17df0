"""The residual add with RMSNorm, the rotary embedding and the gated MLP's SiLU(gate) * up in bfloat16 on the CPU,
one native call each (cpu_norm_rotary.c, built by kernels.cpu_native) instead of a chain of small torch ops. Where
the kernel is not built, or for other dtypes, devices and layouts, they run the torch code they replace, so results
are the same to bfloat16 rounding either way.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native, reference_extra

SOURCE = Path(__file__).with_name("cpu_norm_rotary.c")


_POINTER, _INT = ctypes.c_void_p, ctypes.c_int
_FUNCTIONS = {  # (add_rms_norm, rotary, silu_mul): cpu_native.functions binds them once per process, or gives None
    "pdserve_add_rms_norm_bf16": (None, [_POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, ctypes.c_float,
                                         _INT]),
    "pdserve_rotary_bf16": (None, [_POINTER, ctypes.c_int64, _POINTER, _POINTER, _INT, _INT, _INT, _INT]),
    "pdserve_silu_mul_bf16": (None, [_POINTER, _POINTER, _INT, _INT, _INT]),
}


def available() -> bool:
    return cpu_native.functions(SOURCE, _FUNCTIONS) is not None


def add_rms_norm(
    hidden: torch.Tensor,  # [T, size], or [T, heads, head_dim] (q/k norms): rows are the last dim
    residual: torch.Tensor | None,  # hidden's shape, or None
    weight: torch.Tensor,  # [size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, hidden + residual), hidden's shape
    """kernels.reference_extra.add_rms_norm, natively for bfloat16 on the CPU."""
    functions = cpu_native.functions(SOURCE, _FUNCTIONS)
    if (functions is None or hidden.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or hidden.device.type != "cpu" or not weight.is_contiguous()):
        return reference_extra.add_rms_norm(hidden, residual, weight, eps)
    hidden = hidden.contiguous()
    normed = torch.empty_like(hidden)
    if residual is None:
        summed, added_pointer, summed_pointer = hidden, None, None
    else:
        summed = torch.empty_like(hidden)
        added_pointer, summed_pointer = residual.contiguous().data_ptr(), summed.data_ptr()
    size = hidden.shape[-1]
    functions[0](hidden.data_ptr(), added_pointer, weight.data_ptr(), normed.data_ptr(), summed_pointer,
                 hidden.numel() // size, size, eps, torch.get_num_threads())
    return normed, summed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] rotated with cos and sin [T, 1, D/2] (the halves of one bfloat16 [T, 1, D] cos | sin
    table), every product and sum rounded to bfloat16 as torch rounds them; None where the kernel does not take
    these tensors (the caller then uses torch)."""
    functions = cpu_native.functions(SOURCE, _FUNCTIONS)
    tokens, heads, head_dim = x.shape
    if (functions is None or x.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16 or x.device.type != "cpu"
            or x.stride()[1:] != (head_dim, 1)
            or cos.shape[-1] * 2 != head_dim or cos.stride() != (head_dim, head_dim, 1)
            or sin.data_ptr() != cos.data_ptr() + cos.shape[-1] * cos.element_size()):
        return None
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    functions[1](x.data_ptr(), x.stride(0), cos.data_ptr(), out.data_ptr(), tokens, heads, head_dim,
                 torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] (gate | up) -> [..., I]
    """SiLU(gate) * up, natively for a contiguous bfloat16 CPU tensor (torch's F.silu(gate).mul_(up) elsewhere)."""
    functions = cpu_native.functions(SOURCE, _FUNCTIONS)
    size = gate_up.shape[-1] // 2
    if (functions is None or gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu"
            or not gate_up.is_contiguous()):
        gate, up = gate_up.split(size, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [..., I] buffer, not two
    out = torch.empty((*gate_up.shape[:-1], size), dtype=gate_up.dtype)
    functions[2](gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], size,
                 torch.get_num_threads())
    return out
