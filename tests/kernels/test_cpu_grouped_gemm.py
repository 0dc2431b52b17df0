"""The mixture-of-experts grouped GEMM on pdserve's bf16 CPU kernel (kernels/cpu_grouped_gemm.py) against
kernels/reference_moe.grouped_gemm, and ExpertWeights packed for it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers.moe import ExpertWeights, pack_expert_weights, select_experts
from pdserve.kernels import cpu_gemm, cpu_grouped_gemm, reference_moe

pytestmark = pytest.mark.skipif(cpu_gemm.packed_gemm() is None,
                                reason=f"pdserve's bf16 kernel does not run here: {cpu_gemm.unavailable_reason()}")

OUTPUT_ROUNDING = 2 ** -8  # as tests/kernels/test_cpu_gemm.py: the one rounding of each output to bf16


def _assert_close(out: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    expected = expected.double()
    tolerance = OUTPUT_ROUNDING * expected.abs() + 1e-6 * k ** 0.5 * expected.abs().amax().clamp(min=1)
    error = (out.double() - expected).abs()
    assert (error <= tolerance).all(), f"worst error {(error - tolerance).max().item()} past the tolerance"


def _reference(a: torch.Tensor, b: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """The torch reference on the same bf16 numbers, summed in float32 and not rounded to bf16."""
    return reference_moe.grouped_gemm(a.float(), b.float(), group_ends)


@pytest.mark.parametrize("group_sizes", [
    [3, 1, 4, 2],  # every expert has rows
    [0, 5, 0, 0, 2, 0],  # empty groups, first and last included
    [0, 0, 9, 0],  # one expert takes every row
    [1],  # one expert, one row
    [40, 17, 0, 33],  # several row blocks per group
])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (64, 48), (17, 30)])
def test_grouped_products_match_the_reference(group_sizes, out_features, in_features):
    torch.manual_seed(sum(group_sizes) * 100 + out_features)
    rows, num_experts = sum(group_sizes), len(group_sizes)
    a = torch.randn(rows, in_features, dtype=torch.bfloat16)
    b = torch.randn(num_experts, out_features, in_features, dtype=torch.bfloat16)
    group_ends = torch.tensor(group_sizes).cumsum(0).to(torch.int32)
    out = cpu_grouped_gemm.grouped_gemm(a, cpu_grouped_gemm.pack_experts(b), group_ends)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    _assert_close(out, _reference(a, b, group_ends), in_features)


def test_no_rows_give_an_empty_result():
    b = cpu_grouped_gemm.pack_experts(torch.randn(3, 32, 16, dtype=torch.bfloat16))
    out = cpu_grouped_gemm.grouped_gemm(torch.zeros(0, 16, dtype=torch.bfloat16), b, torch.zeros(3, dtype=torch.int32))
    assert out.shape == (0, 32)


def test_a_float32_input_is_refused_with_the_fix():
    b = cpu_grouped_gemm.pack_experts(torch.randn(2, 32, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16 activations"):
        cpu_grouped_gemm.grouped_gemm(torch.zeros(2, 16), b, torch.tensor([1, 2], dtype=torch.int32))


def test_only_bfloat16_cpu_experts_with_an_even_input_are_supported():
    assert cpu_grouped_gemm.supports(torch.zeros(2, 8, 16, dtype=torch.bfloat16))
    assert not cpu_grouped_gemm.supports(torch.zeros(2, 8, 16))
    assert not cpu_grouped_gemm.supports(torch.zeros(2, 8, 15, dtype=torch.bfloat16))
    assert not cpu_grouped_gemm.supports(torch.zeros(8, 16, dtype=torch.bfloat16))


def _random_experts(dtype: torch.dtype) -> ExpertWeights:
    torch.manual_seed(0)
    experts = ExpertWeights(num_experts=6, hidden_size=64, intermediate_size=48).to(dtype)
    experts.gate_up_proj.data.normal_(0.0, 0.125)
    experts.down_proj.data.normal_(0.0, 0.15)
    return experts


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (32, 2), (7, 6)])
def test_packed_experts_compute_what_the_stacked_weights_do(num_tokens, top_k):
    """ExpertWeights packed: both grouped products on the kernel; the routed output equals the unpacked one's up to
    the bf16 roundings of the intermediate and output (the products are the same numbers)."""
    experts = _random_experts(torch.bfloat16)
    hidden = torch.randn(num_tokens, 64, dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(num_tokens, 6), top_k, renormalize=True)
    plain = experts(hidden, weights, ids)
    assert experts.pack_for_cpu()
    packed = experts(hidden, weights, ids)
    assert packed.dtype == torch.bfloat16 and packed.shape == plain.shape
    torch.testing.assert_close(packed, plain, rtol=4 * OUTPUT_ROUNDING, atol=4 * OUTPUT_ROUNDING)


def test_packing_releases_the_stacked_weights():
    """After packing, the model holds each expert weight once: as panels, not also as the stacked parameters."""
    model = torch.nn.ModuleDict({"bf16": _random_experts(torch.bfloat16), "fp32": _random_experts(torch.float32)})
    stacked_bytes = sum(p.numel() * p.element_size() for p in model["bf16"].parameters())
    assert pack_expert_weights(model) == 1
    bf16, fp32 = model["bf16"], model["fp32"]
    assert bf16.gate_up_proj is None and bf16.down_proj is None and list(bf16.parameters()) == []
    assert sum(p.panels.numel() * p.panels.element_size() for p in bf16.packed) == stacked_bytes  # 96, 64: no pad
    assert fp32.packed is None and fp32.gate_up_proj is not None  # float32 stays on reference_moe
