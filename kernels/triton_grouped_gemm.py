"""Triton grouped GEMM for mixture-of-experts layers: rows sorted by expert, each times its expert's
weight, in one launch with no host synchronisation (the expert groups are read on the device).

Each program owns a BLOCK_M x BLOCK_N tile of the output. A row block may straddle experts: the
program walks the experts its rows belong to, one masked tile product each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES, INDEX_DTYPES, check_contiguous, check_devices, check_shape, check_tensor,
)
from pdserve.kernels.triton_utils import cdiv, dot_precision, next_pow2, upcast_for_dot


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, ends_ptr, out_ptr,
    M, N, K,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    experts = tl.arange(0, EXPERTS_PAD)
    ends = tl.load(ends_ptr + experts, mask=experts < NUM_EXPERTS, other=2147483647)  # [EXPERTS_PAD]
    block_end = tl.minimum(pid_m * BLOCK_M + BLOCK_M, M)
    start = pid_m * BLOCK_M
    while start < block_end:
        expert = tl.sum((ends <= start).to(tl.int32), axis=0)  # the first expert whose group ends past `start`
        segment_end = tl.minimum(tl.load(ends_ptr + expert), block_end)
        in_segment = (rows >= start) & (rows < segment_end)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_in = (k0 + ks) < K
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * K + (k0 + ks)[None, :],
                        mask=in_segment[:, None] & k_in[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            b = tl.load(b_ptr + (expert.to(tl.int64) * N + cols[None, :]) * K + (k0 + ks)[:, None],
                        mask=(cols[None, :] < N) & k_in[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=in_segment[:, None] & (cols[None, :] < N))
        start = segment_end


def _check_args(a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor) -> None:
    check_tensor("a", a, 2, FLOAT_DTYPES)
    check_tensor("b", b, 3, FLOAT_DTYPES)
    check_tensor("group_ends", group_ends, 1, INDEX_DTYPES)
    check_shape("b", b, (None, None, a.shape[1]), "[num_experts, N, K] with K = a's columns")
    check_shape("group_ends", group_ends, (b.shape[0],), "[num_experts]")
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} but b is {b.dtype}: the kernel needs one dtype: cast them to match")
    for name, tensor in (("a", a), ("b", b), ("group_ends", group_ends)):
        check_contiguous(name, tensor)
    check_devices(("a", "b", "group_ends"), (a, b, group_ends))


def grouped_gemm(
    a: torch.Tensor,  # [M, K], rows sorted by expert
    b: torch.Tensor,  # [E, N, K], one [out, in] weight per expert
    group_ends: torch.Tensor,  # [E] int32, cumulative row counts: expert e ends at row group_ends[e]
) -> torch.Tensor:  # [M, N]
    """The Triton kernel of kernels.reference_moe.grouped_gemm (arguments and result as there)."""
    _check_args(a, b, group_ends)
    num_rows, num_cols = a.shape[0], b.shape[1]
    out = torch.empty(num_rows, num_cols, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    block_m = 16 if num_rows <= 64 else 64
    block_n = min(128, max(16, next_pow2(num_cols)))
    block_k = min(64, max(16, next_pow2(a.shape[1])))
    grid = (cdiv(num_rows, block_m), cdiv(num_cols, block_n))
    _grouped_gemm_kernel[grid](
        a, b, group_ends.to(torch.int32), out, num_rows, num_cols, a.shape[1],
        NUM_EXPERTS=b.shape[0], EXPERTS_PAD=next_pow2(b.shape[0]),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast_for_dot(a.dtype), PRECISION=dot_precision(a.dtype),
    )
    return out
