"""kv_pack / kv_unpack move a one-plane latent cache (MLA: [layers, 1, blocks, block_size, 1, width]) the way
they move K and V: Triton equals the torch reference, and a round trip restores the tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.triton_kv_transfer import kv_pack, kv_unpack
from tests.kernels.paged_data import generator_for, nan_like, randn

NUM_LAYERS, NUM_BLOCKS, BLOCK, WIDTH = 3, 7, 16, 72


@pytest.mark.parametrize("num_tokens", [1, BLOCK, 2 * BLOCK + 5])
def test_latent_pack_and_unpack_match_the_reference(num_tokens, request):
    gen = generator_for(request.node.name)
    kv_cache = randn((NUM_LAYERS, 1, NUM_BLOCKS, BLOCK, 1, WIDTH), torch.bfloat16, gen)
    block_ids = torch.randperm(NUM_BLOCKS, generator=gen)[:(num_tokens + BLOCK - 1) // BLOCK]
    packed = kv_pack(kv_cache, block_ids, num_tokens, 1, 3)
    assert packed.shape == (2, 1, num_tokens, 1, WIDTH)
    assert torch.equal(packed, reference.kv_pack(kv_cache, block_ids, num_tokens, 1, 3))
    got, expected = nan_like(kv_cache), nan_like(kv_cache)
    kv_unpack(packed, got, block_ids, num_tokens, layer_start=1)
    reference.kv_unpack(packed, expected, block_ids, num_tokens, layer_start=1)
    assert torch.allclose(got, expected, equal_nan=True, rtol=0, atol=0)
    assert (~torch.isnan(got)).sum() == packed.numel()
    assert torch.equal(reference.kv_pack(got, block_ids, num_tokens, 1, 3), packed)
