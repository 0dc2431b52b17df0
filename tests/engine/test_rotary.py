"""The torch rotary rotates q and k split from one fused projection in one pass, bit for bit as it
rotates them apart."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers.rotary import RotaryEmbedding, _heads_side_by_side


def _fused_qk(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    qkv = torch.randn(tokens, (4 + 2 + 2) * 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k, _ = qkv.split([4 * 16, 2 * 16, 2 * 16], dim=-1)
    return q.view(tokens, 4, 16), k.view(tokens, 2, 16)  # [T, H, D], [T, Hkv, D] views of qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_query_and_key_rotate_as_they_do_apart(dtype):
    q, k = _fused_qk(7, dtype)
    assert _heads_side_by_side(q, k) is not None
    rotation = RotaryEmbedding(16, 64, 1e4, None)(torch.arange(3, 10), dtype)
    together = rotation(q, k)
    apart = rotation(q.clone(), k.clone())  # separate tensors: rotated one at a time
    assert torch.equal(together[0], apart[0]) and torch.equal(together[1], apart[1])
    assert together[0].shape == q.shape and together[1].shape == k.shape


def test_heads_that_do_not_follow_each_other_are_rotated_apart():
    q, k = _fused_qk(3, torch.float32)
    assert _heads_side_by_side(q, k.clone()) is None  # another buffer
    assert _heads_side_by_side(k, q) is None  # key before query
    assert _heads_side_by_side(q, q[:, :2]) is None  # overlapping, not adjacent
