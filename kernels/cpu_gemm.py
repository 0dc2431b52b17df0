"""bfloat16 linear products on the CPU's AVX512-BF16 (cpu_gemm_bf16.c, built by kernels.cpu_native): a weight is
packed once into the kernel's panels, then y = x W^T (+ bias) runs on it for any number of rows.

`packed_gemm()` is None where the kernel cannot run (no compiler, PDSERVE_CPU_KERNEL=torch, or a CPU without
AVX512-BF16); linears then stay on oneDNN (engine/layers/linear.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels import cpu_native

SOURCE = Path(__file__).with_name("cpu_gemm_bf16.c")
BLOCK = 16  # outputs per block; a panel holds pdserve_gemm_bf16_panel_blocks() blocks


_POINTER, _INT = ctypes.c_void_p, ctypes.c_int
_GEMM = {"pdserve_gemm_bf16": (_INT, [_POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT])}


def packed_gemm():
    """The loaded `pdserve_gemm_bf16` function, or None (see unavailable_reason)."""
    bound = cpu_native.functions(SOURCE, _GEMM, ("pdserve_gemm_bf16_supported", "this CPU has no AVX512-BF16"))
    return None if bound is None else bound[0]


def unavailable_reason() -> str | None:
    packed_gemm()  # binds the kernel, or records why it cannot
    return cpu_native.unavailable_reason(SOURCE)


def supports(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a linear with this weight [N, K] runs on the kernel: bfloat16 on the CPU, K even."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and (bias is None or bias.dtype == torch.bfloat16)
            and packed_gemm() is not None)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [N, K] bfloat16 -> flat bfloat16, the kernel's panels
    """The weight in the kernel's layout: blocks of 16 outputs (the last padded with zero rows), grouped into
    panels; within a panel, [K/2][blocks][16][2]: each pair of inputs of every output in the panel together."""
    out_features, in_features = weight.shape
    panel_blocks = cpu_native.library(SOURCE).pdserve_gemm_bf16_panel_blocks()
    blocks = -(-out_features // BLOCK)
    padded = weight.new_zeros(blocks * BLOCK, in_features)
    padded[:out_features] = weight
    pairs = padded.view(blocks, BLOCK, in_features // 2, 2).transpose(1, 2)  # [blocks, K/2, 16, 2]
    panels = [pairs[start:start + panel_blocks].transpose(0, 1).reshape(-1)  # [K/2, blocks, 16, 2]
              for start in range(0, blocks, panel_blocks)]
    return torch.cat(panels)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., K] -> [..., N], bfloat16
    if x.dtype != torch.bfloat16:
        raise TypeError(f"a bfloat16 linear got a {x.dtype} input: cast the activations to the model's dtype")
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty((rows, out_features), dtype=torch.bfloat16)
    packed_gemm()(flat.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                  rows, flat.shape[1], out_features, torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)
