"""`--dtype auto` picks the fastest dtype the device computes natively: bf16 on a CPU with native bf16,
float32 on a CPU without it (the capability probe patched to simulate each), the checkpoint's on a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine import config
from pdserve.engine.config import ConfigError, ModelConfig, choose_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_follows_native_bf16(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    dtype, reason = choose_dtype("auto", "float32", CPU)
    assert dtype == expected
    assert ("has native bf16" in reason) == native_bf16
    assert ("no native bf16" in reason) != native_bf16


def test_the_probe_reads_torchs_cpu_capability(monkeypatch):
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: {"avx512_bf16": False, "amx_bf16": True})
    assert config.cpu_has_native_bf16()
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: {"avx512_bf16": False, "amx_bf16": False})
    assert not config.cpu_has_native_bf16()


def test_a_probe_torch_lacks_means_float32(monkeypatch):
    monkeypatch.delattr(torch._C._cpu, "_get_cpu_capability")
    assert choose_dtype("auto", None, CPU)[0] == torch.float32


def test_auto_on_a_gpu_keeps_the_checkpoints_dtype():
    cuda = torch.device("cuda")
    assert choose_dtype("auto", "float16", cuda)[0] == torch.float16
    assert choose_dtype("auto", "torch.float32", cuda)[0] == torch.float32
    assert choose_dtype("auto", None, cuda)[0] == torch.bfloat16


def test_an_explicit_dtype_wins_over_the_probe(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    assert choose_dtype("float32", "bfloat16", CPU) == (torch.float32, "--dtype float32")
    with pytest.raises(ConfigError, match="use auto, float32"):
        choose_dtype("float64", None, CPU)


def test_the_choice_reaches_the_config_and_the_kv_cache_follows_it(monkeypatch, model_factory, caplog):
    """The demo-like checkpoint stays float32 on disk; only the compute dtype (and so the KV bytes) changes."""
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    model_dir = model_factory("llama")
    bf16 = ModelConfig.from_hf(model_dir, dtype="auto")
    fp32 = ModelConfig.from_hf(model_dir, dtype="float32")
    assert (bf16.dtype, bf16.checkpoint_dtype) == (torch.bfloat16, fp32.checkpoint_dtype)
    assert bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.model_runner import ModelRunner

    with caplog.at_level(logging.INFO, logger="pdserve.engine.model_runner"):
        runner = ModelRunner(bf16, CacheConfig(block_size=4, num_blocks=8), "cpu")
    assert runner.kv_cache.dtype == torch.bfloat16
    assert "computing in bfloat16 (auto: this CPU has native bf16" in caplog.text
