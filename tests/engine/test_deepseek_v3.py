"""DeepSeek-V3 (MLA + group-limited MoE), and DeepSeek-V2, on pdserve's native code: greedy output equals transformers'
generate() token for token in fp32 (batched prompts, chunked prefill, prefix hits, every attention mode),
within the rounding rule in bf16; the KV cache holds one latent row per token and layer, and no block leaks."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from pdserve import LLM
from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.layers.mla import LatentAttention
from pdserve.engine.layers.moe import select_experts_grouped
from pdserve.engine.models.deepseek_v3 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tests.engine.deepseek_models import DEEPSEEK_CASES, DEEPSEEK_V2_CASES, DEEPSEEK_V3_SHAPE, make_deepseek_model_dir
from tests.engine.moe_models import VOCAB_SIZE, model_dir_cache
from tests.engine.test_llm_parity import GREEDY_WITH_LOGPROBS, assert_matches_transformers, make_prompts, run_parity
from tests.engine.test_moe import assert_bf16_parity

NUM_KV_BLOCKS = 256  # of 4 tokens: room for every prompt at once
LATENT_WIDTH = DEEPSEEK_V3_SHAPE["kv_lora_rank"] + DEEPSEEK_V3_SHAPE["qk_rope_head_dim"]  # 48 values per token


@pytest.fixture(scope="module")
def deepseek_dir(model_factory, tmp_path_factory):
    """make(case, dtype="float32") -> a tiny DeepSeek-V3 (or V2) model dir."""
    def build(out, case: str, dtype: str) -> str:
        version, overrides = (2, DEEPSEEK_V2_CASES[case]) if case in DEEPSEEK_V2_CASES else (3, DEEPSEEK_CASES[case])
        return make_deepseek_model_dir(out, model_factory("llama"), dtype, version, **overrides)

    return model_dir_cache(tmp_path_factory, build)


def _latent_layers(llm: LLM) -> list[LatentAttention]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, LatentAttention)]


@pytest.mark.parametrize("case", ["deepseek-v3", "deepseek-v3-plain-q", "deepseek-v3-yarn"])
def test_greedy_matches_transformers_fp32(deepseek_dir, case):
    """Ten prompts of 1 to 70 tokens at once, prefilled in 16-token chunks beside decodes, repeated
    prompts hitting the prefix cache; every block free at the end (run_parity)."""
    llm = run_parity(deepseek_dir(case), make_prompts(VOCAB_SIZE), max_num_batched_tokens=16,
                     num_kv_blocks=NUM_KV_BLOCKS)
    assert type(llm.engine.runner.model) is DeepseekV3ForCausalLM
    assert tuple(llm.engine.runner.kv_cache.shape) == (3, 1, NUM_KV_BLOCKS, 4, 1, LATENT_WIDTH)
    assert llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("case", list(DEEPSEEK_V2_CASES))
def test_deepseek_v2_matches_transformers_fp32(deepseek_dir, case):
    """The same MLA, DeepSeek-V2's softmax routing (greedy, and group-limited by each group's best expert)."""
    llm = run_parity(deepseek_dir(case), make_prompts(VOCAB_SIZE, seed=2), max_num_batched_tokens=16,
                     num_kv_blocks=NUM_KV_BLOCKS)
    assert type(llm.engine.runner.model) is DeepseekV2ForCausalLM


@pytest.mark.parametrize("decode_mode, prefill_mode", list(itertools.product(("absorbed", "decompressed"), repeat=2)))
def test_every_attention_mode_matches_transformers(deepseek_dir, decode_mode, prefill_mode):
    """Absorbed and decompressed attention, in decode steps and in prefill chunks over a cached prefix."""
    model_dir = deepseek_dir("deepseek-v3")
    prompts = make_prompts(VOCAB_SIZE, seed=1)
    llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=NUM_KV_BLOCKS)
    for layer in _latent_layers(llm):
        layer.decode_mode, layer.prefill_mode = decode_mode, prefill_mode
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    assert_matches_transformers(model_dir, prompts, outputs)
    assert llm.kv_cache_manager.num_used_blocks == 0


def test_greedy_matches_transformers_bf16(deepseek_dir):
    """bf16 weights, computed in bf16 by both: equal up to a near tie within the rounding rule of
    tests/engine/parity.py, chosen tokens' logprobs within it too. Every expert is routed to every token:
    with top-2 routing, transformers' own bf16 run of prompt 2 meets an expert near-tie (sigmoid scores
    2e-4 apart in layer 2 at step 4), which any rounding difference flips."""
    assert_bf16_parity(deepseek_dir("deepseek-v3-all-experts", "bfloat16"))


def test_kv_cache_holds_the_latent_only(deepseek_dir):
    """Per token and layer: kv_lora_rank + qk_rope_head_dim values, one row for every head; a full K/V
    cache of the same model would hold heads x (qk_nope + qk_rope + v) values."""
    config = ModelConfig.from_hf(deepseek_dir("deepseek-v3"), dtype="float32")
    assert (config.kv_planes, config.kv_plane_shape) == (1, (1, LATENT_WIDTH))
    assert config.kv_bytes_per_token == 3 * LATENT_WIDTH * 4
    llm = LLM(deepseek_dir("deepseek-v3"), dtype="float32", block_size=4, num_kv_blocks=8)
    cache = llm.engine.runner.kv_cache
    assert cache.numel() * cache.element_size() == 8 * 4 * config.kv_bytes_per_token
    heads, shape = DEEPSEEK_V3_SHAPE["num_attention_heads"], DEEPSEEK_V3_SHAPE
    full_kv_per_layer = heads * (shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] + shape["v_head_dim"])
    assert full_kv_per_layer / LATENT_WIDTH == 5  # this tiny model's saving; DeepSeek-V3's own is 71x


def test_bf16_cache_halves_the_bytes(deepseek_dir):
    assert ModelConfig.from_hf(deepseek_dir("deepseek-v3"), dtype="bfloat16").kv_bytes_per_token == 3 * LATENT_WIDTH * 2


@pytest.mark.parametrize("seed", range(3))
def test_group_limited_routing_equals_transformers(seed):
    """The same experts (as sets) and weights as transformers' DeepseekV3TopkRouter, with a correction
    bias that changes which experts win."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{**DEEPSEEK_V3_SHAPE, "n_routed_experts": 16, "n_group": 4, "topk_group": 2,
                                 "num_experts_per_tok": 3})
    gen = torch.Generator().manual_seed(seed)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=gen)
        router.e_score_correction_bias.normal_(0, 0.3, generator=gen)
    hidden = torch.randn(40, config.hidden_size, generator=gen)
    logits, their_weights, their_ids = router(hidden)
    weights, ids = select_experts_grouped(logits, router.e_score_correction_bias, 3, 4, 2, True, 2.5)
    order, their_order = ids.argsort(dim=-1), their_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))
    unbiased = select_experts_grouped(logits, torch.zeros(16), 3, 4, 2, True, 2.5)[1].sort(dim=-1).values
    assert not torch.equal(unbiased, ids.sort(dim=-1).values), "the bias must change some token's experts"


def _model_dir_copy(model_dir: str, out, config_changes: dict) -> str:
    """`model_dir`'s files linked into `out`, with config.json changed by `config_changes`."""
    config = json.loads(open(f"{model_dir}/config.json").read())
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (out / name).symlink_to(f"{model_dir}/{name}")
    (out / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(out)


def test_sequence_dependent_rope_is_refused_with_the_reason(deepseek_dir, tmp_path):
    model_dir = _model_dir_copy(deepseek_dir("deepseek-v3"), tmp_path, {
        "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}})
    with pytest.raises(ConfigError, match="rope scaling 'dynamic'.*sequence-dependent"):
        LLM(model_dir, dtype="float32", num_kv_blocks=8)


def test_multi_token_prediction_layers_are_skipped(deepseek_dir, tmp_path, caplog):
    """A released checkpoint's extra layer (model.layers.{num_hidden_layers}.*, here a copy of layer 2 with
    MTP's own tensors) loads: skipped with one log line; the model's output is unchanged."""
    model_dir = deepseek_dir("deepseek-v3")
    weights = load_file(f"{model_dir}/model.safetensors")
    extra = {name.replace("model.layers.2.", "model.layers.3."): tensor.clone()
             for name, tensor in weights.items() if name.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    extra["model.layers.3.shared_head.head.weight"] = torch.zeros(VOCAB_SIZE, 64)
    save_file({**weights, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(f"{model_dir}/{name}")
    prompts = make_prompts(VOCAB_SIZE, seed=3)[:3]
    with caplog.at_level(logging.INFO, logger="pdserve.loader"):
        outputs = LLM(str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=64).generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    skips = [r.getMessage() for r in caplog.records if r.name == "pdserve.loader"]
    assert len(skips) == 1 and "layers [3]" in skips[0], skips
    assert_matches_transformers(model_dir, prompts, outputs)


def test_mla_runs_the_torch_paged_backend_on_every_device(deepseek_dir):
    """The Triton kernels read K/V caches only: an MLA model gets the torch-paged backend on CUDA too."""
    from pdserve.engine.attention.torch_paged import TorchPagedBackend
    from pdserve.engine.model_runner import _attn_backend_for

    config = ModelConfig.from_hf(deepseek_dir("deepseek-v3"), dtype="float32")
    assert isinstance(_attn_backend_for(config, torch.device("cuda"), 16), TorchPagedBackend)
