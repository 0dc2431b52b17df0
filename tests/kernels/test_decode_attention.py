"""Triton paged decode attention equals kernels.reference.paged_decode_attention."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.triton_decode_attention import (
    choose_block_n, choose_partition_size, launch_decode_attention, paged_decode_attention,
)
from tests.kernels.paged_data import assert_close, generator_for, make_paged_cache, nan_like, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK = 16
# 1, block_size - 1, block_size, block_size + 1 and several blocks, in one batch.
CONTEXT_LENS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5]


def _run_both(context_lens, num_kv_heads, group, head_dim, dtype, label, partition_size, block_size=BLOCK):
    """(Triton output written into NaNs, reference output) for one random batch; 16-wide tiles."""
    gen = generator_for(label)
    cache = make_paged_cache(context_lens, num_kv_heads, head_dim, dtype, gen, block_size=block_size)
    query = randn((len(context_lens), num_kv_heads * group, head_dim), dtype, gen)
    scale = head_dim**-0.5
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, scale)
    expected = reference.paged_decode_attention(*args)
    out = nan_like(query)
    launch_decode_attention(*args, out, partition_size=partition_size, block_n=16)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,group", [(64, 1), (96, 2), (128, 4), (64, 8)])
def test_unsplit_matches_reference(dtype, head_dim, group, request):
    out, expected = _run_both(CONTEXT_LENS, 2, group, head_dim, dtype, request.node.name, partition_size=4096)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_matches_reference(dtype, request):
    # Partitions of 32 positions (two 16-wide tiles): 1 to 4 partitions per sequence, some unused.
    out, expected = _run_both([1, 31, 32, 33, 100], 2, 4, 96, dtype, request.node.name, partition_size=32)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("block_size", [8, 5])
def test_other_block_sizes_and_tiles_spanning_blocks(block_size, request):
    # A 16-wide tile covers several cache blocks; block size 5 is not a power of two.
    lens = [1, block_size - 1, block_size, block_size + 1, 4 * block_size + 3]
    out, expected = _run_both(lens, 2, 2, 64, torch.float32, request.node.name, 32, block_size=block_size)
    assert_close(out, expected, torch.float32)


def test_public_wrapper_splits_long_contexts(request):
    # 1100 positions > the minimum partition (512): the default path runs split-K with 64-wide tiles.
    max_context = 1100
    assert choose_partition_size(max_context) < max_context
    gen = generator_for(request.node.name)
    cache = make_paged_cache([max_context, 7], 1, 64, torch.float32, gen)
    query = randn((2, 2, 64), torch.float32, gen)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.125)
    assert_close(paged_decode_attention(*args), reference.paged_decode_attention(*args), torch.float32)


def test_strided_query_from_fused_qkv(request):
    # query as a view into a wider [S, q + k + v] projection: only head_dim needs to be contiguous.
    gen = generator_for(request.node.name)
    cache = make_paged_cache([20, 3], 2, 64, torch.float32, gen)
    qkv = randn((2, (4 + 2 + 2) * 64), torch.float32, gen)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    assert not query.is_contiguous()
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.125)
    assert_close(paged_decode_attention(*args), reference.paged_decode_attention(*args), torch.float32)


@pytest.mark.parametrize("partition_size", [4096, 32])
def test_empty_sequence_gets_zeros(partition_size, request):
    # seq_len 0 marks a padding row (e.g. a CUDA-graph batch slot): defined output, no NaN.
    gen = generator_for(request.node.name)
    cache = make_paged_cache([40, 1], 2, 64, torch.float32, gen)
    cache.seq_lens[1] = 0
    query = randn((2, 2, 64), torch.float32, gen)
    out = nan_like(query)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.125)
    launch_decode_attention(*args, out, partition_size=partition_size, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[:1], reference.paged_decode_attention(*args)[:1], torch.float32)


def test_partition_size_rules():
    assert choose_partition_size(100) == 512  # short contexts: one partition
    assert choose_partition_size(4096) == 512  # 8 partitions
    assert choose_partition_size(128 * 1024) == 8192  # capped at 16 partitions
    assert choose_partition_size(1000, block_n=48) % 48 == 0
    assert choose_block_n(128, torch.bfloat16) == 64
    assert choose_block_n(128, torch.float32) == 32  # fp32 rows are twice as wide
