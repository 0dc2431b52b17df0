"""Triton store_kv: write each token's key/value into its paged-cache slot (negative slot = skip)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    check_contiguous_1d,
    check_devices,
    check_last_dim_contiguous,
    check_shape,
    check_tensor,
)
from pdserve.kernels.triton_utils import next_pow2


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_n, stride_kc_b, stride_kc_h,
    stride_vc_n, stride_vc_b, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    # One program per token: copies its [num_kv_heads, head_dim] key and value.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [HEADS_PAD, HEAD_DIM_PAD]

    src_k = key_ptr + token.to(tl.int64) * stride_key_t + heads[:, None] * stride_key_h + dims[None, :]
    src_v = value_ptr + token.to(tl.int64) * stride_value_t + heads[:, None] * stride_value_h + dims[None, :]
    dst_k = key_cache_ptr + block * stride_kc_n + offset * stride_kc_b + heads[:, None] * stride_kc_h
    dst_v = value_cache_ptr + block * stride_vc_n + offset * stride_vc_b + heads[:, None] * stride_vc_h
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(dst_k + dims[None, :], k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v + dims[None, :], v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _check_store_kv_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    for name, tensor in (("key", key), ("value", value)):
        check_tensor(name, tensor, 3, FLOAT_DTYPES)
        check_last_dim_contiguous(name, tensor)
    for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, tensor, 4, FLOAT_DTYPES)
        check_last_dim_contiguous(name, tensor)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    check_contiguous_1d("slot_mapping", slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape("value", value, tuple(key.shape), "same as key: [num_tokens, num_kv_heads, head_dim]")
    cache_shape = (None, None, num_kv_heads, head_dim)
    check_shape("key_cache", key_cache, cache_shape, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_shape("value_cache", value_cache, tuple(key_cache.shape), "same as key_cache")
    check_shape("slot_mapping", slot_mapping, (num_tokens,), "one slot per token of key")
    check_devices(
        ("key", "value", "key_cache", "value_cache", "slot_mapping"),
        (key, value, key_cache, value_cache, slot_mapping),
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor
) -> None:
    """The Triton kernel of kernels.reference.store_kv (arguments, shapes and result as there).

    key/value may be strided views (e.g. slices of a fused QKV output) as long as head_dim is
    contiguous. Slots must lie below num_blocks * block_size (not checked: that would sync the GPU).
    """
    _check_store_kv_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM_PAD=next_pow2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )
