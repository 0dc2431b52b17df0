"""Triton neox-style rotary embedding for query and key in one launch (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES, INDEX_DTYPES, check_contiguous, check_contiguous_1d,
    check_devices, check_last_dim_contiguous, check_same_dtype, check_shape, check_tensor,
)
from pdserve.kernels.triton_utils import next_pow2


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_src_h, stride_dst_h, cos, sin,  # cos/sin: [ROT_HALF_PAD] fp32
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ROT_HALF: tl.constexpr, ROT_HALF_PAD: tl.constexpr,
):
    """Rotate the first 2 * ROT_HALF dims of NUM_HEADS heads of one token; copy the rest."""
    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    halves = tl.arange(0, ROT_HALF_PAD)[None, :]  # [1, ROT_HALF_PAD]
    rot_mask = (heads < NUM_HEADS) & (halves < ROT_HALF)
    src = src_ptr + heads * stride_src_h
    dst = dst_ptr + heads * stride_dst_h
    x1 = tl.load(src + halves, mask=rot_mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + ROT_HALF + halves, mask=rot_mask, other=0.0).to(tl.float32)
    out_type = dst_ptr.dtype.element_ty
    tl.store(dst + halves, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_type), mask=rot_mask)
    tl.store(dst + ROT_HALF + halves, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_type), mask=rot_mask)
    if 2 * ROT_HALF < HEAD_DIM:  # partial rotary: the tail passes through
        dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
        tail_mask = (heads < NUM_HEADS) & (dims >= 2 * ROT_HALF) & (dims < HEAD_DIM)
        tail = tl.load(src + dims, mask=tail_mask, other=0.0)
        tl.store(dst + dims, tail.to(out_type), mask=tail_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, query_ptr, key_ptr, cos_sin_ptr, query_out_ptr, key_out_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h,
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h, stride_cache_pos,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROT_HALF: tl.constexpr, ROT_HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    halves = tl.arange(0, ROT_HALF_PAD)
    cache_row = cos_sin_ptr + position * stride_cache_pos
    cos = tl.load(cache_row + halves, mask=halves < ROT_HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + ROT_HALF + halves, mask=halves < ROT_HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr + token * stride_q_t, query_out_ptr + token * stride_qo_t, stride_q_h, stride_qo_h, cos, sin,
        NUM_HEADS, HEADS_PAD, HEAD_DIM, HEAD_DIM_PAD, ROT_HALF, ROT_HALF_PAD,
    )
    _rotate_heads(
        key_ptr + token * stride_k_t, key_out_ptr + token * stride_ko_t, stride_k_h, stride_ko_h, cos, sin,
        NUM_KV_HEADS, KV_HEADS_PAD, HEAD_DIM, HEAD_DIM_PAD, ROT_HALF, ROT_HALF_PAD,
    )


def _check_rotary_args(positions, query, key, cos_sin_cache) -> None:
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_contiguous_1d("positions", positions)
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    num_tokens, _, head_dim = query.shape
    check_shape("key", key, (num_tokens, None, head_dim), "[num_tokens, num_kv_heads, head_dim], like query")
    check_shape("positions", positions, (num_tokens,), "one position per token")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 != 0 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"cos_sin_cache has {rotary_dim} columns; expected an even rotary_dim <= head_dim={head_dim} "
            f"(cos in the first half, sin in the second)"
        )
    check_same_dtype(("query", "key"), (query, key))
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("key", key)
    check_contiguous("cos_sin_cache", cos_sin_cache)
    check_devices(("positions", "query", "key", "cos_sin_cache"), (positions, query, key, cos_sin_cache))


def launch_rotary_embedding(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    query_out: torch.Tensor,  # [T, num_heads, head_dim], written (may alias query: in place)
    key_out: torch.Tensor,  # [T, num_kv_heads, head_dim], written (may alias key)
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    check_shape("query_out", query_out, tuple(query.shape), "same as query")
    check_shape("key_out", key_out, tuple(key.shape), "same as key")
    check_last_dim_contiguous("query_out", query_out)
    check_last_dim_contiguous("key_out", key_out)
    if num_tokens == 0:
        return
    rot_half = cos_sin_cache.shape[1] // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, query_out, key_out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_pow2(num_heads), KV_HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), ROT_HALF=rot_half, ROT_HALF_PAD=next_pow2(rot_half),
    )


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of kernels.reference_extra.rotary_embedding (arguments, shapes and result as there)."""
    _check_rotary_args(positions, query, key, cos_sin_cache)
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    launch_rotary_embedding(positions, query, key, cos_sin_cache, query_out, key_out)
    return query_out, key_out
