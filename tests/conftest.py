"""Shared fixtures: tiny random-weight Hugging Face model directories, built once per session."""

from __future__ import annotations

import json
import os

import pytest
import torch

# Triton decides between compiling and interpreting when it is first imported (torch._dynamo and
# transformers import it early), so without a GPU the interpreter is chosen here, before any test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch, **config_overrides) -> path of a real HF model dir (cached per argument set)."""
    from pdserve.demo_model import make_demo_model

    built: dict[str, str] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides) -> str:
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"model-{arch}")
            built[key] = str(make_demo_model(out, arch=arch, size="tiny", seed=seed, config_overrides=overrides))
        return built[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _cache_in_tmp(tmp_path_factory):
    """Keep the demo-model cache of the tests out of the user's home."""
    import os

    os.environ.setdefault("PDSERVE_CACHE", str(tmp_path_factory.mktemp("pdserve-cache")))


@pytest.fixture
def pack_every_linear(monkeypatch):
    """Float32 weights run on oneDNN's packed path, small ones too (engine/layers/linear.MIN_PACKED_FP32_ELEMENTS):
    tests of that path use the tiny models, whose weights are all below that size, and run it on CPUs without
    AVX-512 too, whose float32 linears otherwise take pdserve's kernel (oneDNN's path stays where no compiler builds
    it, as in the slim container image)."""
    from pdserve.engine.layers import linear
    from pdserve.kernels import cpu_gemm_f32

    monkeypatch.setattr(linear, "MIN_PACKED_FP32_ELEMENTS", 0)
    monkeypatch.setattr(cpu_gemm_f32, "runs_linears", lambda: False)
