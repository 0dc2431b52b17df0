"""Triton kv_pack / kv_unpack: move a request's KV between the all-layers paged cache and one
contiguous transfer buffer, for a range of layers.

The cache is [num_layers, planes, N, B, *per_token]: planes 2 (K, V) or 1 (an MLA latent). A cache block
holds its B tokens contiguously ([B, *per_token]), and the buffer holds tokens contiguously too, so each
(layer, plane, block) is one contiguous run of tokens_in_block * prod(per_token) elements on both sides.
Programs copy CHUNK-element pieces of those runs: grid = (layers * planes, blocks, chunks per block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_contiguous_1d,
    check_devices,
    check_non_negative_int,
    check_shape,
    check_tensor,
)
from pdserve.kernels.triton_utils import cdiv, next_pow2

MAX_CHUNK = 4096  # elements per program


@triton.jit
def _kv_copy_kernel(
    kv_cache_ptr, buffer_ptr, block_ids_ptr,
    num_tokens, layer_start,
    stride_c_layer, stride_c_kv, stride_c_block,
    TOKEN_NUMEL: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, TO_BUFFER: tl.constexpr,
    PLANES: tl.constexpr,
):
    layer_kv = tl.program_id(0)  # index into the buffer's [num_layers_moved, PLANES]
    block_index = tl.program_id(1)  # index into block_ids
    chunk = tl.program_id(2)
    tokens_here = tl.minimum(num_tokens - block_index * BLOCK_SIZE, BLOCK_SIZE)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < tokens_here * TOKEN_NUMEL

    layer = layer_start + layer_kv // PLANES
    kv = layer_kv % PLANES
    block_id = tl.load(block_ids_ptr + block_index).to(tl.int64)
    cache_run = (kv_cache_ptr + layer.to(tl.int64) * stride_c_layer + kv * stride_c_kv
                 + block_id * stride_c_block)
    buffer_run = buffer_ptr + (layer_kv.to(tl.int64) * num_tokens + block_index * BLOCK_SIZE) * TOKEN_NUMEL
    if TO_BUFFER:
        values = tl.load(cache_run + offsets, mask=mask)
        tl.store(buffer_run + offsets, values.to(buffer_ptr.dtype.element_ty), mask=mask)
    else:
        values = tl.load(buffer_run + offsets, mask=mask)
        tl.store(cache_run + offsets, values.to(kv_cache_ptr.dtype.element_ty), mask=mask)


def _check_cache_and_blocks(kv_cache, block_ids, num_tokens, layer_start, layer_end) -> None:
    check_tensor("kv_cache", kv_cache, 6, FLOAT_DTYPES)
    if kv_cache.shape[1] not in (1, 2):
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; expected [num_layers, planes, num_blocks, "
            f"block_size, num_kv_heads, head_dim] with planes 2 (K then V) or 1 (a latent)"
        )
    block_size, num_kv_heads, head_dim = kv_cache.shape[3:]
    inner = (num_kv_heads * head_dim, head_dim, 1)
    if kv_cache.stride()[3:] != inner:
        raise ValueError(
            f"kv_cache strides {kv_cache.stride()} do not keep each block's [block_size, num_kv_heads, "
            f"head_dim] contiguous (expected last strides {inner}): pass the cache allocation itself"
        )
    check_tensor("block_ids", block_ids, 1, INDEX_DTYPES)
    check_contiguous_1d("block_ids", block_ids)
    check_non_negative_int("num_tokens", num_tokens)
    if block_ids.shape[0] * block_size < num_tokens:
        raise ValueError(
            f"block_ids holds {block_ids.shape[0]} blocks of {block_size} tokens, fewer than "
            f"num_tokens={num_tokens}: pass every block that holds the tokens"
        )
    num_layers = kv_cache.shape[0]
    ints = isinstance(layer_start, int) and isinstance(layer_end, int)
    if not (ints and 0 <= layer_start <= layer_end <= num_layers):
        raise ValueError(
            f"layer range [{layer_start}, {layer_end}) must satisfy 0 <= layer_start <= layer_end <= "
            f"num_layers={num_layers}"
        )


def _check_buffer(name: str, buffer: torch.Tensor, kv_cache: torch.Tensor, num_tokens: int) -> None:
    check_tensor(name, buffer, 5, FLOAT_DTYPES)
    check_contiguous(name, buffer)
    expected = (None, kv_cache.shape[1], num_tokens, *kv_cache.shape[4:])
    check_shape(name, buffer, expected, "[num_layers_moved, planes, num_tokens, num_kv_heads, head_dim]")


def _launch_copy(kv_cache, buffer, block_ids, num_tokens, layer_start, num_layers_moved, to_buffer) -> None:
    block_size = kv_cache.shape[3]
    token_numel = kv_cache.shape[4] * kv_cache.shape[5]
    if num_tokens == 0 or num_layers_moved == 0:
        return
    planes = kv_cache.shape[1]
    chunk = min(MAX_CHUNK, next_pow2(block_size * token_numel))
    grid = (num_layers_moved * planes, cdiv(num_tokens, block_size), cdiv(block_size * token_numel, chunk))
    _kv_copy_kernel[grid](
        kv_cache, buffer, block_ids,
        num_tokens, layer_start,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        TOKEN_NUMEL=token_numel, BLOCK_SIZE=block_size, CHUNK=chunk, TO_BUFFER=to_buffer, PLANES=planes,
    )


def kv_pack(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, layer_start: int = 0,
    layer_end: int | None = None
) -> torch.Tensor:
    """The Triton kernel of kernels.reference.kv_pack (arguments, shapes and result as there)."""
    check_tensor("kv_cache", kv_cache, 6, FLOAT_DTYPES)
    layer_end = kv_cache.shape[0] if layer_end is None else layer_end
    _check_cache_and_blocks(kv_cache, block_ids, num_tokens, layer_start, layer_end)
    check_devices(("kv_cache", "block_ids"), (kv_cache, block_ids))
    num_layers_moved = layer_end - layer_start
    buffer = torch.empty(
        (num_layers_moved, kv_cache.shape[1], num_tokens, *kv_cache.shape[4:]), dtype=kv_cache.dtype,
        device=kv_cache.device,
    )
    _launch_copy(kv_cache, buffer, block_ids, num_tokens, layer_start, num_layers_moved, to_buffer=True)
    return buffer


def launch_kv_pack(
    kv_cache: torch.Tensor,  # [num_layers, planes, N, B, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_blocks]
    num_tokens: int,
    layer_start: int,
    out: torch.Tensor,  # [num_layers_moved, planes, num_tokens, num_kv_heads, head_dim], contiguous, written
) -> None:
    """kv_pack into a caller-provided buffer (reuse a pinned/preallocated one; tests poison it)."""
    check_tensor("out", out, 5, FLOAT_DTYPES)
    check_non_negative_int("layer_start", layer_start)
    num_layers_moved = out.shape[0]
    _check_cache_and_blocks(kv_cache, block_ids, num_tokens, layer_start, layer_start + num_layers_moved)
    _check_buffer("out", out, kv_cache, num_tokens)
    check_devices(("kv_cache", "block_ids", "out"), (kv_cache, block_ids, out))
    _launch_copy(kv_cache, out, block_ids, num_tokens, layer_start, num_layers_moved, to_buffer=True)


def kv_unpack(
    buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, layer_start: int = 0
) -> None:
    """The Triton kernel of kernels.reference.kv_unpack (arguments, shapes and result as there)."""
    check_tensor("buffer", buffer, 5, FLOAT_DTYPES)
    num_layers_in = buffer.shape[0]
    check_non_negative_int("layer_start", layer_start)
    _check_cache_and_blocks(kv_cache, block_ids, num_tokens, layer_start, layer_start + num_layers_in)
    _check_buffer("buffer", buffer, kv_cache, num_tokens)
    check_devices(("buffer", "kv_cache", "block_ids"), (buffer, kv_cache, block_ids))
    _launch_copy(kv_cache, buffer, block_ids, num_tokens, layer_start, num_layers_in, to_buffer=False)
