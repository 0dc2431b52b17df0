"""Triton paged prefill attention equals kernels.reference.paged_prefill_attention."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.triton_prefill_attention import choose_tiles, launch_prefill_attention, paged_prefill_attention
from tests.kernels.paged_data import assert_close, generator_for, make_paged_cache, nan_like, query_start_loc, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK = 16
# (cached prefix, new tokens) per sequence, all in one ragged batch: no prefix (one token, more than
# a block), a prefix ending mid-block, a prefix of whole blocks, a sequence with no new tokens.
RAGGED_BATCH = [(0, 1), (0, BLOCK + 1), (BLOCK - 1, 3), (2 * BLOCK, BLOCK), (5, 0), (BLOCK + 1, 2 * BLOCK + 3)]


def _run_both(batch, num_kv_heads, group, head_dim, dtype, label, block_m=16, block_n=16):
    gen = generator_for(label)
    context_lens = [prefix + new for prefix, new in batch]
    num_new = [new for _, new in batch]
    cache = make_paged_cache(context_lens, num_kv_heads, head_dim, dtype, gen, block_size=BLOCK)
    query = randn((sum(num_new), num_kv_heads * group, head_dim), dtype, gen)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, query_start_loc(num_new),
            cache.seq_lens, head_dim**-0.5)
    expected = reference.paged_prefill_attention(*args)
    out = nan_like(query)
    launch_prefill_attention(*args, out, block_m=block_m, block_n=block_n)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,group", [(64, 1), (96, 2), (128, 4), (64, 8)])
def test_ragged_batch_matches_reference(dtype, head_dim, group, request):
    out, expected = _run_both(RAGGED_BATCH, 2, group, head_dim, dtype, request.node.name)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("group", [3, 5])
def test_group_not_a_power_of_two(group, request):
    # 16 rows hold 5 (group 3) or 3 (group 5) tokens of the whole group, plus masked spare rows.
    out, expected = _run_both(RAGGED_BATCH, 1, group, 64, torch.float32, request.node.name)
    assert_close(out, expected, torch.float32)


def test_single_sequence_without_prefix(request):
    out, expected = _run_both([(0, 37)], 2, 2, 64, torch.float32, request.node.name)
    assert_close(out, expected, torch.float32)


def test_single_token_chunks_like_decode(request):
    # Every sequence adds one token over a prefix: the prefill kernel handles decode-shaped batches.
    out, expected = _run_both([(0, 1), (16, 1), (40, 1)], 2, 4, 64, torch.float16, request.node.name)
    assert_close(out, expected, torch.float16)


def test_public_wrapper_default_tiles(request):
    gen = generator_for(request.node.name)
    batch = [(3, 70), (64, 5)]
    cache = make_paged_cache([p + n for p, n in batch], 2, 64, torch.float32, gen)
    query = randn((75, 4, 64), torch.float32, gen)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, query_start_loc([70, 5]),
            cache.seq_lens, 0.125)
    assert_close(paged_prefill_attention(*args), reference.paged_prefill_attention(*args), torch.float32)


def test_causal_mask_is_applied(request):
    # Changing a later token's key must not change an earlier token's output.
    gen = generator_for(request.node.name)
    cache = make_paged_cache([20], 1, 64, torch.float32, gen)
    query = randn((20, 1, 64), torch.float32, gen)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, query_start_loc([20]),
            cache.seq_lens, 0.125)
    before = paged_prefill_attention(*args)
    last_block = int(cache.block_tables[0, 1])
    cache.key_cache[last_block, 19 - 16] += 5.0  # position 19, the last token
    after = paged_prefill_attention(*args)
    assert torch.equal(before[:19], after[:19])
    assert not torch.allclose(before[19], after[19])


def test_tiles_shrink_for_wide_rows():
    # Wider rows (fp32, head_dim 256) get smaller tiles so the pipelined tiles fit in shared memory.
    assert choose_tiles(128, torch.bfloat16) == (64, 64)
    assert choose_tiles(96, torch.float32) == (64, 32)
    assert choose_tiles(256, torch.bfloat16) == (64, 32)
    assert choose_tiles(256, torch.float32) == (32, 16)
