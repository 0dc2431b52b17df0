"""Triton grouped_gemm equals its reference in kernels.reference_moe, and the reference equals one
plain matmul per row: rows straddling tile borders, experts with no rows, odd shapes, half types."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference_moe
from pdserve.kernels.triton_grouped_gemm import grouped_gemm
from tests.kernels.paged_data import assert_close, generator_for, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def sorted_rows(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of each row [M], group_ends [E] int32) for rows sorted by expert with these counts."""
    expert_ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return expert_ids, torch.tensor(counts).cumsum(0).to(torch.int32)


def per_row_products(a: torch.Tensor, b: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([a[i].float() @ b[e].float().t() for i, e in enumerate(expert_ids.tolist())])


# (row counts per expert, N, K): decode-sized groups, an expert with no rows, a group straddling the
# 16- and 64-row tiles, shapes that are not multiples of the tile, one expert holding every row.
CASES = {
    "decode": ([1, 0, 2, 1], 64, 32),
    "straddling": ([5, 0, 0, 23, 40, 9], 96, 64),
    "odd-shapes": ([3, 7, 0, 11], 40, 24),
    "one-expert": ([0, 70, 0], 128, 80),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_matches_reference(case, dtype, request):
    counts, n, k = CASES[case]
    gen = generator_for(request.node.name)
    expert_ids, group_ends = sorted_rows(counts)
    a = randn((len(expert_ids), k), dtype, gen)
    b = randn((len(counts), n, k), dtype, gen) / k**0.5
    expected = reference_moe.grouped_gemm(a, b, group_ends)
    assert expected.shape == (len(expert_ids), n) and expected.dtype == dtype
    assert_close(expected, per_row_products(a, b, expert_ids), dtype)
    assert_close(grouped_gemm(a, b, group_ends), expected, dtype)


@pytest.mark.parametrize("counts, n, k", [([2, 0, 3], 8, 6), ([4, 1], 64, 32)])
def test_reference_both_paths_agree(counts, n, k, request):
    """Shapes torch's grouped_mm refuses (rows not 16-byte multiples) take the per-expert loop."""
    gen = generator_for(request.node.name)
    expert_ids, group_ends = sorted_rows(counts)
    a, b = randn((len(expert_ids), k), torch.float32, gen), randn((len(counts), n, k), torch.float32, gen)
    torch.testing.assert_close(reference_moe.grouped_gemm(a, b, group_ends), per_row_products(a, b, expert_ids))
    torch.testing.assert_close(reference_moe._expert_loop(a, b, group_ends), per_row_products(a, b, expert_ids))


def test_no_rows():
    b = torch.zeros(3, 16, 16)
    ends = torch.zeros(3, dtype=torch.int32)
    assert grouped_gemm(torch.zeros(0, 16), b, ends).shape == (0, 16)
    assert reference_moe.grouped_gemm(torch.zeros(0, 16), b, ends).shape == (0, 16)


@pytest.mark.parametrize("b_shape, ends, expected", [
    ((2, 8, 5), torch.tensor([1, 3], dtype=torch.int32), r"b has shape \(2, 8, 5\); expected .* K = a.s columns"),
    ((2, 8, 4), torch.tensor([3], dtype=torch.int32), r"group_ends has shape \(1,\); expected \(2,\)"),
    ((2, 8, 4), torch.tensor([1.0, 3.0]), "group_ends has dtype torch.float32"),
])
def test_bad_arguments_are_named(b_shape, ends, expected):
    with pytest.raises(ValueError, match=expected):
        grouped_gemm(torch.zeros(3, 4), torch.zeros(b_shape), ends)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_layer_on_the_triton_kernel_matches_torch(dtype, monkeypatch, request):
    """The whole routed-experts computation of engine/layers/moe.py (sort by expert, both grouped
    GEMMs, weights, the sum over each token's experts) with the Triton kernel, as on CUDA."""
    from pdserve.engine.layers import moe

    gen = generator_for(request.node.name)
    num_tokens, top_k, num_experts, hidden, inter = 19, 2, 6, 32, 16
    hidden_states = randn((num_tokens, hidden), dtype, gen)
    gate_up = randn((num_experts, 2 * inter, hidden), dtype, gen) / hidden**0.5
    down = randn((num_experts, hidden, inter), dtype, gen) / inter**0.5
    weights, ids = moe.select_experts(randn((num_tokens, num_experts), torch.float32, gen), top_k, True)
    args = (hidden_states, weights, ids, gate_up, down, moe.silu_and_mul, torch.arange(num_experts))
    expected = moe.routed_experts(*args)
    monkeypatch.setattr(moe, "kernel_for", lambda name, device: grouped_gemm)
    assert_close(moe.routed_experts(*args), expected, dtype)
