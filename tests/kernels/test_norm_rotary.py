"""Triton add_rms_norm and rotary_embedding equal their references in kernels.reference_extra."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import reference_extra
from pdserve.kernels.triton_norm import add_rms_norm, launch_add_rms_norm
from pdserve.kernels.triton_rotary import launch_rotary_embedding, rotary_embedding
from tests.kernels.paged_data import assert_close, generator_for, nan_like, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden_size", [64, 96, 1000])
def test_add_rms_norm_matches_reference(dtype, hidden_size, request):
    gen = generator_for(request.node.name)
    hidden = randn((7, hidden_size), dtype, gen)
    residual = randn((7, hidden_size), dtype, gen)
    weight = randn((hidden_size,), dtype, gen)
    expected_out, expected_residual = reference_extra.add_rms_norm(hidden, residual, weight, 1e-6)
    out, new_residual = nan_like(hidden), nan_like(hidden)
    launch_add_rms_norm(hidden, residual, weight, 1e-6, out, new_residual)
    if dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: 1 ulp apart.
        assert_close(new_residual, expected_residual, dtype)
    else:
        assert torch.equal(new_residual, expected_residual)  # the sum rounds like torch's
    assert_close(out, expected_out, dtype)


def test_add_rms_norm_without_residual_and_strided_rows(request):
    gen = generator_for(request.node.name)
    wide = randn((5, 2 * 128), torch.float32, gen)
    hidden = wide[:, :128]  # rows strided, columns contiguous
    weight = randn((128,), torch.float32, gen)
    out, new_residual = add_rms_norm(hidden, None, weight, 1e-5)
    expected_out, expected_residual = reference_extra.add_rms_norm(hidden, None, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)
    assert_close(out, expected_out, torch.float32)


def _cos_sin_cache(max_position: int, rotary_dim: int) -> torch.Tensor:  # [max_position, rotary_dim]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (96, 96), (128, 64)])
def test_rotary_matches_reference(dtype, head_dim, rotary_dim, request):
    gen = generator_for(request.node.name)
    positions = torch.randint(0, 50, (6,), generator=gen)
    query = randn((6, 4, head_dim), dtype, gen)
    key = randn((6, 2, head_dim), dtype, gen)
    cos_sin = _cos_sin_cache(50, rotary_dim)
    expected_q, expected_k = reference_extra.rotary_embedding(positions, query, key, cos_sin)
    q_out, k_out = nan_like(query), nan_like(key)
    launch_rotary_embedding(positions, query, key, cos_sin, q_out, k_out)
    assert_close(q_out, expected_q, dtype)
    assert_close(k_out, expected_k, dtype)


def test_rotary_reference_is_neox_rotation():
    # Position p rotates the pair (x[i], x[i + rot/2]) by angle p * inv_freq[i]; position 0 is identity.
    cos_sin = _cos_sin_cache(8, 4)
    query = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    rotated, _ = reference_extra.rotary_embedding(torch.tensor([3]), query, query, cos_sin)
    assert torch.allclose(rotated[0, 0], torch.tensor([math.cos(3.0), 0.0, math.sin(3.0), 0.0]), atol=1e-6)
    same, _ = reference_extra.rotary_embedding(torch.tensor([0]), query, query, cos_sin)
    assert torch.equal(same, query)


def test_rotary_in_place_on_fused_qkv_views(request):
    gen = generator_for(request.node.name)
    qkv = randn((5, (4 + 2 + 2) * 64), torch.float32, gen)
    query = qkv[:, : 4 * 64].view(5, 4, 64)
    key = qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64)
    positions = torch.arange(5)
    cos_sin = _cos_sin_cache(16, 64)
    expected_q, expected_k = reference_extra.rotary_embedding(positions, query, key, cos_sin)
    value_before = qkv[:, 6 * 64 :].clone()
    launch_rotary_embedding(positions, query, key, cos_sin, query, key)  # in place
    assert_close(query, expected_q, torch.float32)
    assert_close(key, expected_k, torch.float32)
    assert torch.equal(qkv[:, 6 * 64 :], value_before)


def test_rotary_public_wrapper_leaves_inputs_alone(request):
    gen = generator_for(request.node.name)
    positions = torch.tensor([4, 0, 9])
    query, key = randn((3, 2, 64), torch.bfloat16, gen), randn((3, 1, 64), torch.bfloat16, gen)
    query_before, key_before = query.clone(), key.clone()
    cos_sin = _cos_sin_cache(10, 64)
    q_out, k_out = rotary_embedding(positions, query, key, cos_sin)
    expected_q, expected_k = reference_extra.rotary_embedding(positions, query, key, cos_sin)
    assert torch.equal(query, query_before) and torch.equal(key, key_before)
    assert_close(q_out, expected_q, torch.bfloat16)
    assert_close(k_out, expected_k, torch.bfloat16)
