"""Triton kv_pack / kv_unpack equal kernels.reference.kv_pack / kv_unpack, for layer ranges."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.triton_kv_transfer import kv_pack, kv_unpack, launch_kv_pack
from tests.kernels.paged_data import generator_for, nan_like, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS = 4, 9, 16, 2


def _cache_and_blocks(dtype, head_dim, num_tokens, gen):
    kv_cache = randn((NUM_LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, head_dim), dtype, gen)
    num_blocks = max(1, (num_tokens + BLOCK - 1) // BLOCK)
    block_ids = torch.randperm(NUM_BLOCKS, generator=gen)[:num_blocks].to(torch.int32)  # shuffled
    return kv_cache, block_ids


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7])
def test_pack_matches_reference(dtype, num_tokens, request):
    gen = generator_for(request.node.name)
    kv_cache, block_ids = _cache_and_blocks(dtype, 96, num_tokens, gen)
    expected = reference.kv_pack(kv_cache, block_ids, num_tokens, 1, 3)
    out = nan_like(expected)
    launch_kv_pack(kv_cache, block_ids, num_tokens, 1, out)
    assert torch.equal(out, expected)
    assert torch.equal(kv_pack(kv_cache, block_ids.long(), num_tokens, 1, 3), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, BLOCK, BLOCK + 1, 3 * BLOCK + 7])
def test_unpack_matches_reference(dtype, num_tokens, request):
    gen = generator_for(request.node.name)
    kv_cache, block_ids = _cache_and_blocks(dtype, 64, num_tokens, gen)
    buffer = randn((2, 2, num_tokens, KV_HEADS, 64), dtype, gen)
    got, expected = nan_like(kv_cache), nan_like(kv_cache)
    kv_unpack(buffer, got, block_ids, num_tokens, layer_start=2)
    reference.kv_unpack(buffer, expected, block_ids, num_tokens, layer_start=2)
    assert torch.allclose(got, expected, equal_nan=True, rtol=0, atol=0)
    assert (~torch.isnan(got)).sum() == buffer.numel()  # wrote the buffer's tokens and nothing else


def test_pack_then_unpack_round_trip_all_layers(request):
    gen = generator_for(request.node.name)
    kv_cache, block_ids = _cache_and_blocks(torch.bfloat16, 128, 40, gen)
    packed = kv_pack(kv_cache, block_ids, 40)  # default range: every layer
    assert packed.shape == (NUM_LAYERS, 2, 40, KV_HEADS, 128) and packed.is_contiguous()
    destination = nan_like(kv_cache)
    other_blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:3]
    kv_unpack(packed, destination, other_blocks, 40)
    assert torch.equal(reference.kv_pack(destination, other_blocks, 40), packed)


def test_zero_tokens_and_empty_layer_range(request):
    gen = generator_for(request.node.name)
    kv_cache, block_ids = _cache_and_blocks(torch.float32, 64, 1, gen)
    assert kv_pack(kv_cache, block_ids, 0).shape == (NUM_LAYERS, 2, 0, KV_HEADS, 64)
    assert kv_pack(kv_cache, block_ids, 5, 2, 2).shape == (0, 2, 5, KV_HEADS, 64)
