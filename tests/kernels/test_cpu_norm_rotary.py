"""The CPU's native residual add + RMSNorm and rotary (kernels/cpu_norm_rotary.c) against the torch code they
replace: the same bfloat16 values, and that code itself for other dtypes."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.torch_paged import TorchPagedBackend
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding, TableRotation
from pdserve.kernels import cpu_norm_rotary, reference_extra

pytestmark = pytest.mark.skipif(not cpu_norm_rotary.available(), reason="the native CPU kernels do not build here")


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (3, 9, 64), (5, 100), (1500, 96)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_matches_the_torch_code_in_bf16(shape, with_residual):
    torch.manual_seed(shape[0])
    hidden, weight = _bf16(*shape), _bf16(shape[-1])
    residual = _bf16(*shape) if with_residual else None
    normed, summed = cpu_norm_rotary.add_rms_norm(hidden, residual, weight, 1e-5)
    expected_normed, expected_summed = reference_extra.add_rms_norm(hidden, residual, weight, 1e-5)
    assert normed.shape == hidden.shape and normed.dtype == torch.bfloat16
    assert torch.equal(summed, expected_summed)
    # only the float32 sum order of the mean differs: at most one bf16 step, on a rare element
    steps = (normed.float() - expected_normed.float()).abs() / expected_normed.float().abs().clamp(min=1e-30)
    assert (steps <= 2 ** -7).all() and (normed != expected_normed).float().mean() < 1e-3


def test_a_norm_of_q_heads_split_from_one_projection():
    torch.manual_seed(1)
    qkv = _bf16(4, 15 * 64)
    query = qkv[:, :576].view(4, 9, 64)  # not contiguous: rows of 960
    weight = _bf16(64)
    normed, _ = cpu_norm_rotary.add_rms_norm(query, None, weight, 1e-6)
    assert torch.equal(normed, reference_extra.add_rms_norm(query, None, weight, 1e-6)[0])


def test_float32_runs_the_torch_code_itself():
    hidden, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    for got, expected in zip(cpu_norm_rotary.add_rms_norm(hidden, residual, weight, 1e-6),
                             reference_extra.add_rms_norm(hidden, residual, weight, 1e-6)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("tokens", [1, 37, 1100])
def test_rotary_matches_the_torch_rotation_bit_for_bit(tokens):
    torch.manual_seed(tokens)
    table = torch.randn(4096, 64)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = _bf16(tokens, 15 * 64)
    query, key = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
    expected = TableRotation(table, positions, torch.bfloat16)(query, key)
    native = TableRotation(table, positions, torch.bfloat16, native_rotate=cpu_norm_rotary.rotate)
    for got, want in zip(native(query, key), expected):
        assert torch.equal(got, want)
    separate = native(query.contiguous(), key.contiguous())  # q and k not side by side: rotated one by one
    assert torch.equal(separate[0], expected[0]) and torch.equal(separate[1], expected[1])


def test_rotary_leaves_what_it_does_not_take_to_torch():
    cos_sin = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    cos, sin = cos_sin.chunk(2, dim=-1)
    assert cpu_norm_rotary.rotate(torch.randn(2, 3, 64), cos.float(), sin.float()) is None  # float32
    assert cpu_norm_rotary.rotate(_bf16(2, 64, 3).transpose(1, 2), cos, sin) is None  # dims not contiguous
    assert cpu_norm_rotary.rotate(_bf16(2, 3, 32), cos, sin) is None  # partial rotation


def test_the_cpu_backend_binds_them_to_the_models_norms_and_rotary():
    model = torch.nn.ModuleDict({"norm": RMSNorm(64), "rotary": RotaryEmbedding(64, 128, 10000.0, None)})
    TorchPagedBackend(block_size=16).bind_layer_kernels(model)
    assert model["norm"].kernel is cpu_norm_rotary.add_rms_norm
    rotation = model["rotary"](torch.arange(3), torch.bfloat16)
    assert rotation.native_rotate is cpu_norm_rotary.rotate


@pytest.mark.parametrize("rows, size", [(1, 1536), (8, 1536), (2048, 1536), (5, 100), (3, 7)])
def test_silu_and_mul_matches_the_torch_code_in_bf16(rows, size):
    torch.manual_seed(rows)
    gate_up = _bf16(rows, 2 * size) * 4  # gates out to about +-16: sigmoid's both tails
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp(-|x|) underflows to 0 on either side; 0 exactly
    got = cpu_norm_rotary.silu_and_mul(gate_up)
    gate, up = gate_up.split(size, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert got.shape == (rows, size) and got.dtype == torch.bfloat16
    # the same roundings; only exp differs (2e-7 relative) from torch's: at most one bf16 step, on a rare element
    steps = (got.float() - expected.float()).abs() / expected.float().abs().clamp(min=1e-30)
    assert (steps <= 2 ** -7).all() and (got != expected).float().mean() < 1e-3


def test_silu_and_mul_runs_the_torch_code_for_float32_and_views():
    gate_up = torch.randn(4, 64)
    assert torch.equal(cpu_norm_rotary.silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:])
    wide = _bf16(4, 100)[:, :64]  # not contiguous
    assert torch.equal(cpu_norm_rotary.silu_and_mul(wide), torch.nn.functional.silu(wide[:, :32]) * wide[:, 32:])
