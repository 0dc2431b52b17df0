"""Triton store_kv equals kernels.reference.store_kv, padded (-1) slots included."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.triton_store_kv import store_kv
from tests.kernels.paged_data import generator_for, nan_like, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _slots(num_tokens: int, num_slots: int, num_padded: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random slots, with num_padded of them replaced by -1 at random places."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    padded = torch.randperm(num_tokens, generator=gen)[:num_padded]
    slots[padded] = -1
    return slots  # int64


def _store_both(key, value, cache_shape, slots, cache_dtype):
    """Run both implementations on NaN-filled caches; returns (triton caches, reference caches)."""
    caches = [nan_like(torch.empty(cache_shape, dtype=cache_dtype)) for _ in range(4)]
    reference.store_kv(key, value, caches[0], caches[1], slots)
    store_kv(key, value, caches[2], caches[3], slots)
    return caches[2:], caches[:2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 96), (4, 128)])
def test_matches_reference_with_padded_slots(dtype, num_kv_heads, head_dim, request):
    gen = generator_for(request.node.name)
    num_blocks, block_size, num_tokens = 6, 16, 23
    key = randn((num_tokens, num_kv_heads, head_dim), dtype, gen)
    value = randn((num_tokens, num_kv_heads, head_dim), dtype, gen)
    slots = _slots(num_tokens, num_blocks * block_size, 4, gen)
    (k_got, v_got), (k_ref, v_ref) = _store_both(
        key, value, (num_blocks, block_size, num_kv_heads, head_dim), slots, dtype
    )
    assert torch.allclose(k_got, k_ref, equal_nan=True, rtol=0, atol=0)
    assert torch.allclose(v_got, v_ref, equal_nan=True, rtol=0, atol=0)
    # Exactly the non-padded tokens were written, nothing else.
    written_slots = (~torch.isnan(k_got)).all(-1).all(-1).flatten().nonzero().flatten()
    assert sorted(written_slots.tolist()) == sorted(slots[slots >= 0].tolist())


def test_strided_key_value_from_fused_qkv(request):
    # key/value as views of a [T, q + k + v] projection, as the attention layer produces them.
    gen = generator_for(request.node.name)
    num_tokens, num_kv_heads, head_dim = 9, 2, 64
    qkv = randn((num_tokens, (4 + 2 + 2) * head_dim), torch.float16, gen)
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 6 * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = _slots(num_tokens, 3 * 16, 2, gen)
    (k_got, v_got), (k_ref, v_ref) = _store_both(key, value, (3, 16, num_kv_heads, head_dim), slots, torch.float16)
    assert torch.allclose(k_got, k_ref, equal_nan=True, rtol=0, atol=0)
    assert torch.allclose(v_got, v_ref, equal_nan=True, rtol=0, atol=0)


def test_layer_view_of_all_layers_cache(request):
    # The engine passes kv_cache[layer, 0] / kv_cache[layer, 1] views of the all-layers tensor.
    gen = generator_for(request.node.name)
    kv_cache = nan_like(torch.empty(3, 2, 4, 16, 2, 64))
    expected = kv_cache.clone()
    key, value = randn((5, 2, 64), torch.float32, gen), randn((5, 2, 64), torch.float32, gen)
    slots = _slots(5, 64, 1, gen)
    store_kv(key, value, kv_cache[1, 0], kv_cache[1, 1], slots)
    reference.store_kv(key, value, expected[1, 0], expected[1, 1], slots)
    assert torch.allclose(kv_cache, expected, equal_nan=True, rtol=0, atol=0)


def test_all_slots_padded_writes_nothing(request):
    gen = generator_for(request.node.name)
    key = randn((4, 1, 64), torch.float32, gen)
    cache = nan_like(torch.empty(2, 16, 1, 64))
    store_kv(key, key, cache, cache.clone(), torch.full((4,), -1, dtype=torch.int64))
    assert torch.isnan(cache).all()
