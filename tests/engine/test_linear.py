"""Linear layers on CPU: weights reordered for oneDNN once at load, same products as F.linear; float32 ones on
pdserve's AVX2 kernel where the CPU lacks AVX-512."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve import LLM
from pdserve.engine.layers.linear import Linear, MergedLinear, pack_linear_weights
from pdserve.kernels import cpu_gemm_f32


@pytest.fixture(autouse=True)
def float32_on_onednn(monkeypatch):
    """The tests here are of oneDNN's path: float32 weights stay off pdserve's AVX2 kernel, which a CPU without
    AVX-512 gives them (its own tests: tests/kernels/test_cpu_gemm_f32.py, and the last test here)."""
    monkeypatch.setattr(cpu_gemm_f32, "runs_linears", lambda: False)


def _filled(linear: Linear) -> Linear:
    with torch.no_grad():
        linear.weight.copy_(torch.randn_like(linear.weight))
        if linear.bias is not None:
            linear.bias.copy_(torch.randn_like(linear.bias))
    return linear


@pytest.mark.parametrize("rows", [1, 3, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias, pack_every_linear):
    torch.manual_seed(rows)
    linear = _filled(Linear(64, 96, bias=bias))
    weight, x = linear.weight.detach().clone(), torch.randn(rows, 64)
    expected = F.linear(x, weight, linear.bias)
    assert linear.pack_for_cpu(keep_weight=False)
    assert linear.weight is None  # released: packing must not double the model's memory
    out = linear(x)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_fp16_weights_stay_on_f_linear():
    linear = _filled(Linear(16, 8).half())
    assert not linear.pack_for_cpu(keep_weight=False)
    assert linear.packed_weight is None and linear.weight is not None
    x = torch.randn(2, 16).half()
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight))


class _TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.qkv = MergedLinear(16, {"q": 16, "k": 8, "v": 8})
        self.head = Linear(16, 50)
        self.head.weight = self.embed.weight


def test_pack_keeps_weights_shared_with_other_modules(pack_every_linear):
    model = _TiedModel()
    _filled(model.qkv)
    assert pack_linear_weights(model) == 2
    assert model.qkv.weight is None  # only the Linear used it
    assert model.head.weight is model.embed.weight  # the embedding still needs it
    ids = torch.tensor([3, 7])
    hidden = model.embed(ids)
    torch.testing.assert_close(model.head(hidden), hidden @ model.embed.weight.T, rtol=1e-5, atol=1e-5)


def test_loaded_cpu_model_runs_on_packed_weights(model_factory, pack_every_linear):
    llm = LLM(model_factory("llama"), dtype="float32", num_kv_blocks=16)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)


def test_small_float32_weights_stay_on_f_linear_and_large_ones_pack():
    small, large = _filled(Linear(64, 96)), _filled(Linear(256, 256))  # 6,144 and 65,536 elements
    x = torch.randn(3, 64)
    expected = F.linear(x, small.weight)
    assert not small.pack_for_cpu(keep_weight=False)
    assert small.packed_weight is None and small.weight is not None
    assert torch.equal(small(x), expected)  # F.linear itself
    assert large.pack_for_cpu(keep_weight=False) == torch.backends.mkldnn.is_available()


def test_small_bf16_weights_pack_where_the_cpu_runs_bf16_on_onednn():
    small = _filled(Linear(64, 96)).to(torch.bfloat16)
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16))
    except RuntimeError:
        pytest.skip("this CPU runs no bf16 linear on oneDNN")
    assert small.pack_for_cpu(keep_weight=False)


def test_transformers_backend_linears_run_packed(model_factory, pack_every_linear):
    llm = LLM(model_factory("llama"), dtype="float32", num_kv_blocks=16, model_impl="transformers")
    hf_model = llm.engine.runner.model.hf_model
    linears = [m for m in hf_model.modules() if type(m) is nn.Linear]
    embedding = hf_model.get_input_embeddings().weight
    assert linears and all(m.packed_weight is not None for m in linears)
    # released but still a Parameter, unless tied to the embedding (this model's lm_head is not)
    assert all(m.weight.numel() == 0 for m in linears if m.weight is not embedding)
    assert embedding.numel() > 0


@pytest.mark.skipif(cpu_gemm_f32.packed_gemm() is None, reason="pdserve's float32 kernel does not run here")
def test_a_cpu_without_avx512_runs_float32_models_on_pdserves_kernel(model_factory, monkeypatch):
    """The same greedy tokens as on oneDNN, every linear on the kernel's panels and none left on oneDNN."""
    model = model_factory("llama")
    from pdserve import SamplingParams

    prompts = [{"prompt_token_ids": [5, 9, 2, 7, 11, 3]}, {"prompt_token_ids": [1, 4]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model, dtype="float32", num_kv_blocks=16).generate(prompts, params)]
    monkeypatch.setattr(cpu_gemm_f32, "runs_linears", lambda: True)
    llm = LLM(model, dtype="float32", num_kv_blocks=16)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.native_weight is not None and m.packed_weight is None for m in linears)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
