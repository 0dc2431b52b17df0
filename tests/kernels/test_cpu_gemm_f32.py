"""pdserve's float32 linear kernel for CPUs with AVX2 (kernels/cpu_gemm_f32.c) against float64 products, and the
Linear layer that runs on it where the CPU lacks AVX-512."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.layers.linear import Linear, pack_linear_weights
from pdserve.kernels import cpu_gemm_f32, cpu_native
from tests.kernels.thread_counts import at_thread_counts

pytestmark = pytest.mark.skipif(cpu_gemm_f32.packed_gemm() is None,
                                reason=f"pdserve's float32 kernel does not run here: {cpu_gemm_f32.unavailable_reason()}")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # float64
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _assert_close_to_reference(out: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> None:
    # float32 sums of K products, then the bias: each of the K + 1 additions rounds by at most 2^-24 of the
    # running sum's magnitude, which the sum of |products| (and |bias|) bounds
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = magnitude * (x.shape[-1] + 1) * 2 ** -24 + 1e-30
    error = (out.double() - expected).abs()
    assert (error <= bound).all(), f"worst error {(error / bound).max().item():.2f}x the bound"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 12, 13, 100, 200])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (16, 64), (17, 3), (8, 100), (200, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_float64_sums(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 1000 + out_features)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    bias_values = torch.randn(out_features) if bias else None
    out = cpu_gemm_f32.linear(x, cpu_gemm_f32.pack_weight(weight), out_features, bias_values)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    _assert_close_to_reference(out, _reference(x, weight, bias_values), x, weight, bias_values)


# an odd count of panels, a narrow last one, a single panel, rows past a chunk of the kernel (192)
@pytest.mark.parametrize("rows, out_features", [(13, 3000), (8, 576), (3, 1000), (9, 24), (1, 17), (400, 72)])
def test_more_threads_give_the_bytes_one_thread_gives(rows, out_features):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576), torch.randn(out_features, 576)
    packed = cpu_gemm_f32.pack_weight(weight)
    results = at_thread_counts(lambda: cpu_gemm_f32.linear(x, packed, out_features))
    _assert_close_to_reference(results[0], _reference(x, weight, None), x, weight)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_a_row_is_the_same_in_any_batch():
    """Each output sums its products in one order whatever the batch: a request's logits do not depend on
    which other requests share its step."""
    torch.manual_seed(1)
    x, weight = torch.randn(437, 576), torch.randn(200, 576)
    packed = cpu_gemm_f32.pack_weight(weight)
    batch = cpu_gemm_f32.linear(x, packed, 200)
    for start, stop in ((0, 1), (5, 6), (3, 11), (8, 37), (20, 24), (190, 200), (0, 437)):
        assert torch.equal(cpu_gemm_f32.linear(x[start:stop], packed, 200), batch[start:stop])


def test_the_packed_layout_puts_input_k_of_a_panels_outputs_together():
    panel_blocks = cpu_native.library(cpu_gemm_f32.SOURCE).pdserve_gemm_f32_panel_blocks()
    panel = cpu_gemm_f32.BLOCK * panel_blocks
    out_features, in_features = panel + 3, 5  # one full panel and a narrow one (padded to a block)
    weight = torch.arange(out_features * in_features, dtype=torch.float32).view(out_features, in_features)
    packed = cpu_gemm_f32.pack_weight(weight)
    assert packed.numel() == (panel + cpu_gemm_f32.BLOCK) * in_features
    full = packed[:panel * in_features].view(in_features, panel)  # [K, outputs of the panel]
    assert torch.equal(full, weight[:panel].T)
    narrow = packed[panel * in_features:].view(in_features, cpu_gemm_f32.BLOCK)
    assert torch.equal(narrow[:, :3], weight[panel:].T) and not narrow[:, 3:].any()


def test_a_wrong_input_dtype_is_named():
    packed = cpu_gemm_f32.pack_weight(torch.randn(16, 8))
    with pytest.raises(TypeError, match="a float32 linear got a torch.bfloat16 input"):
        cpu_gemm_f32.linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, 16)


def test_linears_take_it_only_where_the_cpu_lacks_avx512(monkeypatch):
    for flags, expected in (("flags : fpu avx2 fma", True), ("flags : fpu avx2 fma avx512f avx512bw", False)):
        monkeypatch.setattr(cpu_native, "cpu_flags", lambda flags=flags: flags)
        cpu_gemm_f32.runs_linears.cache_clear()
        assert cpu_gemm_f32.runs_linears() is expected
        assert cpu_gemm_f32.supports(torch.zeros(8, 8), None) is expected
    cpu_gemm_f32.runs_linears.cache_clear()
    assert not cpu_gemm_f32.supports(torch.zeros(8, 8, dtype=torch.bfloat16), None)
    assert not cpu_gemm_f32.supports(torch.zeros(8, 8), torch.zeros(8, dtype=torch.bfloat16))


def test_float32_linears_pack_for_the_kernel_and_release_their_weight(monkeypatch, caplog):
    monkeypatch.setattr(cpu_gemm_f32, "runs_linears", lambda: True)  # as on a CPU without AVX-512
    torch.manual_seed(2)
    model = torch.nn.Sequential(Linear(64, 96, bias=True), Linear(96, 32))
    for layer in model:
        layer.weight.data.normal_()
        if layer.bias is not None:
            layer.bias.data.normal_()
    x = torch.randn(5, 64)
    hidden = model[0](x)
    expected = model[1](hidden)
    weights = [layer.weight.clone() for layer in model]
    with caplog.at_level(logging.INFO, logger="pdserve.engine.layers.linear"):
        assert pack_linear_weights(model) == 2
    assert "CPU linears: 2 on pdserve's kernels, 0 on oneDNN" in caplog.text
    assert all(layer.native_weight is not None and layer.weight is None for layer in model)
    assert torch.allclose(model(x), expected, rtol=1e-4, atol=1e-3)  # F.linear before, the kernel after
    _assert_close_to_reference(model[0](x), _reference(x, weights[0], model[0].bias), x, weights[0], model[0].bias)
