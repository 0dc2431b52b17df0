"""What every Triton kernel module shares: the interpreter flag and small launch-time helpers.

Importing this module imports triton; only the Triton kernel modules import it, so the CPU engine
(torch backend) never pays for it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.kernels import triton_interpreter_compat


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Read once: triton decides at decoration time (when a kernel module is imported) whether a kernel
# is compiled for the GPU or run by the Python interpreter, so this flag matches the kernels below.
INTERPRET = _interpreting()
if INTERPRET:
    triton_interpreter_compat.apply()

# log2(e): the kernels take exp2 of scores pre-multiplied by scale * LOG2E.
LOG2E = 1.4426950408889634


def next_pow2(value: int) -> int:
    return triton.next_power_of_2(max(1, int(value)))


def cdiv(numerator: int, denominator: int) -> int:
    return (numerator + denominator - 1) // denominator


def upcast_for_dot(dtype: torch.dtype) -> bool:
    """Whether a kernel must turn its tiles into fp32 before tl.dot.

    On the GPU tl.dot takes fp16/bf16 tiles directly (tensor cores). The interpreter keeps bf16 as raw
    uint16 bits and computes garbage with them, so under TRITON_INTERPRET bf16 tiles go through fp32.
    (The interpreter also truncates fp32 -> bf16 casts where the GPU rounds to nearest: bf16 results
    there can be 1 ulp off; the tests' bf16 tolerance covers it.)
    """
    return INTERPRET and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products ("ieee"), not TF32, so fp32 results match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """Keyword arguments for a kernel launch, leaving Triton's defaults where None is given."""
    options = {}
    if num_warps is not None:
        options["num_warps"] = num_warps
    if num_stages is not None:
        options["num_stages"] = num_stages
    return options


@triton.jit
def load_kv_tile(table_row, key_cache_ptr, value_cache_ptr, positions, pos_mask, dims, dim_mask, kv_head,
                 stride_k_n, stride_k_b, stride_k_h, stride_v_n, stride_v_b, stride_v_h,
                 BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V rows of one KV head for `positions` of a sequence, read through its block-table row:
    two [BLOCK_N, HEAD_DIM_PAD] tiles, zero where masked (fp32 when UPCAST)."""
    blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    offsets = positions % BLOCK_SIZE
    kv_mask = pos_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
    k_rows = key_cache_ptr + blocks * stride_k_n + offsets * stride_k_b + kv_head * stride_k_h
    v_rows = value_cache_ptr + blocks * stride_v_n + offsets * stride_v_b + kv_head * stride_v_h
    k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
