"""float32 linear products on the CPU's AVX2 and FMA (cpu_gemm_f32.c, built by kernels.cpu_native): a weight is
packed once into the kernel's panels, then y = x W^T (+ bias) runs on it for any number of rows.

Linears use it on CPUs without AVX-512 (`runs_linears()`): there oneDNN's float32 products of a decode step's few
rows streamed this model's weights at half the memory's speed (docs/results.md, CPU kernels), and on AVX-512 CPUs
oneDNN's wider products stay. `packed_gemm()` is None where the kernel cannot run (no compiler,
PDSERVE_CPU_KERNEL=torch, or a CPU without AVX2 and FMA).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.kernels import cpu_native

SOURCE = Path(__file__).with_name("cpu_gemm_f32.c")
BLOCK = 8  # outputs per block; a panel holds pdserve_gemm_f32_panel_blocks() blocks

_POINTER, _INT = ctypes.c_void_p, ctypes.c_int
_GEMM = {"pdserve_gemm_f32": (_INT, [_POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT])}


def packed_gemm():
    """The loaded `pdserve_gemm_f32` function, or None (see unavailable_reason)."""
    bound = cpu_native.functions(SOURCE, _GEMM, ("pdserve_gemm_f32_supported", "this CPU has no AVX2 and FMA"))
    return None if bound is None else bound[0]


def unavailable_reason() -> str | None:
    packed_gemm()  # binds the kernel, or records why it cannot
    return cpu_native.unavailable_reason(SOURCE)


@functools.cache
def runs_linears() -> bool:
    """Whether float32 linears use this kernel here: it runs, and the CPU has no AVX-512 (oneDNN's products there
    are twice as wide as this kernel's)."""
    return packed_gemm() is not None and "avx512f" not in cpu_native.cpu_flags().split()


def supports(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a linear with this weight [N, K] runs on the kernel: float32 on a CPU where runs_linears()."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and (bias is None or bias.dtype == torch.float32) and runs_linears())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [N, K] float32 -> flat float32, the kernel's panels
    """The weight in the kernel's layout: blocks of 8 outputs (the last padded with zero rows), grouped into
    panels; within a panel, [K][blocks][8]: input k of every output in the panel together."""
    out_features, in_features = weight.shape
    panel_blocks = cpu_native.library(SOURCE).pdserve_gemm_f32_panel_blocks()
    blocks = -(-out_features // BLOCK)
    padded = weight.new_zeros(blocks * BLOCK, in_features)
    padded[:out_features] = weight
    by_block = padded.view(blocks, BLOCK, in_features)  # [blocks, 8, K]
    panels = [by_block[start:start + panel_blocks].permute(2, 0, 1).reshape(-1)  # [K, blocks, 8]
              for start in range(0, blocks, panel_blocks)]
    return torch.cat(panels)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., K] -> [..., N], float32
    if x.dtype != torch.float32:
        raise TypeError(f"a float32 linear got a {x.dtype} input: cast the activations to the model's dtype")
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty((rows, out_features), dtype=torch.float32)
    packed_gemm()(flat.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                  rows, flat.shape[1], out_features, torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)
