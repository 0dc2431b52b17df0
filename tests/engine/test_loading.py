"""Model loading paths: sharded checkpoints, dtypes, KV cache sizing, hub ids when offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, ModelConfig, cpu_has_native_bf16
from pdserve.engine.loader import ModelLoadError, resolve_model_dir, safetensors_files
from pdserve.engine.model_runner import kv_cache_num_blocks
from tests.engine.parity import assert_greedy_match, hf_greedy
from tests.engine.test_llm_parity import NEW_TOKENS, make_prompts

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(20, 57))}]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_sharded_checkpoint_loads_like_single_file(model_factory, tmp_path):
    source = model_factory("qwen3")
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{source}/{name}", sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 3
    assert tokens(LLM(str(sharded), dtype="float32", num_kv_blocks=32)) == tokens(
        LLM(source, dtype="float32", num_kv_blocks=32))


def test_missing_shard_is_named(model_factory, tmp_path):
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(model_factory("llama")).save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    with pytest.raises(ModelLoadError, match=f"missing: {victim}"):
        safetensors_files(sharded)


@pytest.mark.parametrize("dtype, expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                             ("auto", None)])
def test_dtypes(model_factory, dtype, expected):
    """Weights and KV cache in the asked dtype, and greedy output equal to transformers run in that same
    dtype (ties and logprobs within two rounding steps of the largest logit: tests/engine/parity.py).
    auto: this CPU's native choice (bf16 with avx512_bf16 or AMX, else float32)."""
    expected = expected or (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    model_dir = model_factory("llama")
    llm = LLM(model_dir, dtype=dtype, block_size=4, num_kv_blocks=256)
    assert llm.engine.runner.kv_cache.dtype == expected
    assert next(llm.engine.runner.model.parameters()).dtype == expected
    prompts = make_prompts(1024)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=expected).eval()
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        theirs, logits = hf_greedy(reference, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert_greedy_match(completion.token_ids, theirs, logits, f"{dtype} prompt {i}", completion.logprobs,
                            dtype=expected)
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_kv_cache_sized_from_memory_budget(model_factory):
    config = ModelConfig.from_hf(model_factory("llama"), dtype="float32")
    # 2 (K, V) x 2 layers x 2 kv heads x 16 head_dim x 4 bytes = 512 bytes per token
    assert config.kv_bytes_per_token == 512
    budget = CacheConfig(block_size=16, memory_bytes=512 * 16 * 10 + 100)
    assert kv_cache_num_blocks(config, budget, torch.device("cpu")) == 10
    with pytest.raises(MemoryError, match="holds no block"):
        kv_cache_num_blocks(config, CacheConfig(memory_bytes=100), torch.device("cpu"))


def test_hub_id_offline_gives_clear_error(tmp_path):
    """In a fresh process with HF_HUB_OFFLINE=1 (read at import), so no request ever leaves the machine."""
    code = (
        "from pdserve.engine.loader import resolve_model_dir, ModelLoadError\n"
        "from pdserve.engine.tokenizer import load_tokenizer, TokenizerLoadError\n"
        "try:\n    resolve_model_dir('nobody/no-such-model')\n"
        "except ModelLoadError as e:\n    print('ERROR:', e)\n"
        "try:\n    load_tokenizer('nobody/no-such-model')\n"
        "except TokenizerLoadError as e:\n    print('ERROR:', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    model_error, tokenizer_error = result.stdout.splitlines()
    assert model_error.startswith("ERROR: HF_HUB_OFFLINE is set and the model of 'nobody/no-such-model' is not in "
                                  "the local HF cache"), result.stdout + result.stderr
    assert tokenizer_error.startswith("ERROR: HF_HUB_OFFLINE is set and the tokenizer of 'nobody/no-such-model'")
    for line in (model_error, tokenizer_error):
        assert "pass a local model directory" in line and "directory needs" not in line, "a hub id is no directory"
