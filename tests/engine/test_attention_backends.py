"""Attention backends: chosen once per model runner, prepared once per step for every layer, and the
Triton backend's fused norm and rotary kernels equal the torch code they replace."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pdserve import LLM, SamplingParams
from pdserve.engine.attention.selector import get_attn_backend
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.kernels import dispatch


def test_cpu_runner_prepares_once_per_step_for_every_layer(model_factory, monkeypatch):
    llm = LLM(model_factory("llama"), dtype="float32", block_size=4, num_kv_blocks=64)
    backend = llm.engine.runner.attn_backend
    assert backend.name == "torch-paged"
    prepares, layer_calls = [], []
    prepare, forward = backend.prepare, backend.forward
    monkeypatch.setattr(backend, "prepare", lambda context: prepares.append(1) or prepare(context))
    monkeypatch.setattr(backend, "forward", lambda *args: layer_calls.append(1) or forward(*args))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11]}], params)
    assert len(prepares) == 4  # one prefill step of both prompts, then three decode steps
    assert len(layer_calls) == llm.model_config.num_layers * len(prepares)


def test_backend_follows_the_device_unless_forced(monkeypatch):
    assert get_attn_backend(torch.device("cpu"), 16).name == "torch-paged"
    assert get_attn_backend(torch.device("cuda"), 16).name == "triton"  # builds nothing on the device
    monkeypatch.setattr(dispatch, "FORCED_BACKEND", "triton")
    assert get_attn_backend(torch.device("cpu"), 16).name == "triton"
    monkeypatch.setattr(dispatch, "FORCED_BACKEND", "torch")
    assert get_attn_backend(torch.device("cuda"), 16).name == "torch-paged"


def test_triton_backend_gives_norms_and_rotary_its_fused_kernels(monkeypatch):
    from pdserve.kernels.triton_utils import INTERPRET

    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU")
    from pdserve.engine.attention.triton import TritonBackend
    from pdserve.kernels import triton_norm, triton_rotary

    device = "cpu" if INTERPRET else "cuda"  # compiled kernels take CUDA tensors only

    launches = []
    for module, name in ((triton_norm, "launch_add_rms_norm"), (triton_rotary, "launch_rotary_embedding")):
        launch = getattr(module, name)
        counted = lambda *args, launch=launch, name=name: launches.append(name) or launch(*args)  # noqa: E731
        monkeypatch.setattr(module, name, counted)
    gen = torch.Generator().manual_seed(0)
    ours = nn.ModuleDict({"norm": RMSNorm(64), "head_norm": RMSNorm(16), "rotary": RotaryEmbedding(16, 32, 1e4, None)})
    for norm in (ours["norm"], ours["head_norm"]):
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen))
    ours.to(device)
    torch_code = copy.deepcopy(ours)
    TritonBackend().bind_layer_kernels(ours)

    hidden, residual = torch.randn(5, 64, generator=gen).to(device), torch.randn(5, 64, generator=gen).to(device)
    for got, want in zip(ours["norm"](hidden, residual), torch_code["norm"](hidden, residual), strict=True):
        torch.testing.assert_close(got, want)
    qkv = torch.randn(5, 8 * 16, generator=gen).to(device)  # fused projection output: q and k are strided views
    query, key = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    torch.testing.assert_close(ours["head_norm"](query), torch_code["head_norm"](query))
    positions = torch.tensor([0, 3, 7, 30, 31], device=device)
    rotated = ours["rotary"](positions, torch.float32)(query, key)
    for got, want in zip(rotated, torch_code["rotary"](positions, torch.float32)(query, key), strict=True):
        torch.testing.assert_close(got, want)
    assert launches == ["launch_add_rms_norm", "launch_add_rms_norm", "launch_rotary_embedding"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_runs_compiled_triton_kernels(model_factory):
    """On a GPU machine the suite's CUDA engine tests must measure compiled kernels, never the
    interpreter that the CPU kernel tests use (tests/kernels/conftest.py keeps it out of this process)."""
    from pdserve.kernels.triton_utils import INTERPRET

    assert not INTERPRET, "TRITON_INTERPRET=1 leaked into a process with a CUDA device"
    llm = LLM(model_factory("llama"), device="cuda", dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.runner.attn_backend.name == "triton"
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
