"""pdserve's bf16 linear kernel for the CPU (kernels/cpu_gemm_bf16.c) against float64 products, and the Linear
layer that runs on it."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.layers.linear import Linear, pack_linear_weights
from pdserve.kernels import cpu_gemm, cpu_native
from tests.kernels.thread_counts import at_thread_counts

pytestmark = pytest.mark.skipif(cpu_gemm.packed_gemm() is None,
                                reason=f"pdserve's bf16 kernel does not run here: {cpu_gemm.unavailable_reason()}")

# bf16 products are exact and the sums float32, so the only error is the one rounding of the output to bf16
# (relative 2^-8) plus float32 sums over K terms; against float64 sums of the same bf16 numbers
OUTPUT_ROUNDING = 2 ** -8


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # float64
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _assert_close_to_reference(out: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    # per output: the output's rounding, plus float32 rounding of sums whose terms can cancel
    tolerance = OUTPUT_ROUNDING * expected.abs() + 1e-6 * k ** 0.5 * expected.abs().amax().clamp(min=1)
    error = (out.double() - expected).abs()
    assert (error <= tolerance).all(), f"worst error {(error - tolerance).max().item()} past the tolerance"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 16, 31, 100])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (64, 64), (65, 2), (17, 100), (200, 30)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_float64_sums(rows, out_features, in_features, bias):
    torch.manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias_values = torch.randn(out_features, dtype=torch.bfloat16) if bias else None
    out = cpu_gemm.linear(x, cpu_gemm.pack_weight(weight), out_features, bias_values)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    _assert_close_to_reference(out, _reference(x, weight, bias_values), in_features)


# (rows, outputs): outputs split in half panels (an odd count of panels, a narrow last one, a single full panel
# and a narrow one) and rows split (from 32 a thread, with a remainder past a multiple of 8)
@pytest.mark.parametrize("rows, out_features", [(13, 3000), (8, 576), (3, 1000), (9, 65), (64, 576), (203, 1000)])
def test_more_threads_give_the_bytes_one_thread_gives(rows, out_features):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576, dtype=torch.bfloat16), torch.randn(out_features, 576, dtype=torch.bfloat16)
    packed = cpu_gemm.pack_weight(weight)
    results = at_thread_counts(lambda: cpu_gemm.linear(x, packed, out_features))
    _assert_close_to_reference(results[0], _reference(x, weight, None), 576)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_a_row_is_the_same_in_any_batch():
    """Each output sums its products in one order whatever the batch: a request's logits do not depend on
    which other requests share its step."""
    torch.manual_seed(1)
    x, weight = torch.randn(37, 576, dtype=torch.bfloat16), torch.randn(200, 576, dtype=torch.bfloat16)
    packed = cpu_gemm.pack_weight(weight)
    batch = cpu_gemm.linear(x, packed, 200)
    for start, stop in ((0, 1), (5, 6), (3, 11), (8, 37), (20, 24)):
        assert torch.equal(cpu_gemm.linear(x[start:stop], packed, 200), batch[start:stop])


def test_the_packed_layout_puts_each_input_pair_of_a_panels_outputs_together():
    panel_blocks = cpu_native.library(cpu_gemm.SOURCE).pdserve_gemm_bf16_panel_blocks()
    out_features, in_features = cpu_gemm.BLOCK * panel_blocks + 3, 4  # one full panel and a narrow one
    torch.manual_seed(3)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    packed = cpu_gemm.pack_weight(weight)
    width = cpu_gemm.BLOCK * panel_blocks
    full = packed[:width * in_features].view(in_features // 2, width, 2)  # [K/2, outputs, 2]
    assert torch.equal(full[1, 5], weight[5, 2:4])  # output 5's inputs 2 and 3
    narrow = packed[width * in_features:].view(in_features // 2, cpu_gemm.BLOCK, 2)
    assert torch.equal(narrow[0, 2], weight[width + 2, 0:2])
    assert not narrow[:, 3:].any()  # outputs past N are zero


def test_an_input_of_another_dtype_is_refused_with_the_fix():
    packed = cpu_gemm.pack_weight(torch.randn(16, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="cast the activations to the model's dtype"):
        cpu_gemm.linear(torch.randn(2, 8), packed, 16)


def test_what_the_kernel_does_not_take_stays_on_onednn_or_f_linear():
    assert not cpu_gemm.supports(torch.zeros(8, 7, dtype=torch.bfloat16), None)  # odd K
    assert not cpu_gemm.supports(torch.zeros(8, 8), None)  # float32: oneDNN
    assert not cpu_gemm.supports(torch.zeros(8, 8, dtype=torch.bfloat16), torch.zeros(8))  # a float32 bias
    odd = Linear(7, 16).to(torch.bfloat16)
    odd.pack_for_cpu(keep_weight=False)
    assert odd.native_weight is None


def test_bf16_linears_pack_for_the_kernel_and_release_their_weight(caplog):
    torch.manual_seed(2)
    model = torch.nn.Sequential(Linear(64, 96, bias=True), Linear(96, 32)).to(torch.bfloat16)
    for layer in model:
        layer.weight.data.normal_()
        if layer.bias is not None:
            layer.bias.data.normal_()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    hidden = _reference(x, model[0].weight, model[0].bias).to(torch.bfloat16)
    expected = _reference(hidden, model[1].weight, None)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.layers.linear"):
        assert pack_linear_weights(model) == 2
    assert "CPU linears: 2 on pdserve's kernels, 0 on oneDNN" in caplog.text
    assert all(layer.native_weight is not None and layer.weight is None for layer in model)
    _assert_close_to_reference(model(x), expected, 96)


def test_with_pdserve_cpu_kernel_torch_bf16_linears_run_on_onednn(monkeypatch, caplog):
    monkeypatch.setenv(cpu_native.ENV_VAR, "torch")
    monkeypatch.setattr(cpu_native, "_state", {})  # as in a fresh process
    layer = Linear(64, 96).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.layers.linear"):
        pack_linear_weights(torch.nn.Sequential(layer))
    assert layer.native_weight is None
    assert "pdserve's kernel is unavailable (PDSERVE_CPU_KERNEL=torch)" in caplog.text
