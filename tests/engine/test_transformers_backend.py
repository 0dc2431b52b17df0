"""The transformers backend: transformers' layers on pdserve's runtime, greedy-equal to generate().

Native architectures run through the backend with model_impl="transformers"; architectures pdserve
has no code for (Phi-3, GPT-NeoX, Granite, OLMo-2, Gemma, GPT-2) run from tiny random HF model dirs built
here. Every parity run batches prompts of many lengths, chunks prefills (small step budget), hits
the prefix cache with repeated prompts and ends with every KV block free (tests.engine.test_llm_parity).
One non-native model also runs disaggregated, prefill and decode in separate processes.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.loader import ModelLoadError, load_model
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.registry import UnsupportedArchitectureError, resolve_model_class
from pdserve.engine.models.transformers_backend import (
    TransformersForCausalLM,
    UnsupportedModelFeatureError,
    unsupported_features,
)
from tests.engine.moe_models import save_random_model
from tests.engine.test_llm_parity import make_prompts, run_parity

VOCAB_SIZE = 1024
NUM_KV_BLOCKS = 256  # of 4 tokens: room for every prompt at once, and far quicker to allocate than 1 GiB
_SHAPE = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1,
          "pad_token_id": 2}

# Non-native architectures, each with what makes it differ from Llama.
NON_NATIVE_CASES = {
    # fused qkv_proj and gate_up_proj weights, GQA
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2}),
    # partial rotary (25% of head_dim), parallel residual, LayerNorm with biases, fused qkv, GELU MLP
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    # embedding/residual multipliers, attention scale 0.2 instead of head_dim**-0.5, logits / 1.5
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "num_key_value_heads": 2, "embedding_multiplier": 2.0, "residual_multiplier": 0.7,
        "attention_multiplier": 0.2, "logits_scaling": 1.5,
    }),
    # q/k RMSNorm over all heads, norms after attention and MLP
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"num_key_value_heads": 2}),
    # explicit head_dim 32 != hidden/heads, MQA, embeddings scaled by sqrt(hidden), (1 + w) norms, tied
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 32, "num_key_value_heads": 1}),
    # learned absolute positions, Conv1D weights, config names n_embd/n_head/n_layer, a scale per layer
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_inner": 128, "scale_attn_by_inverse_layer_idx": True}),
}

# Plain Llama runs through the backend in test_backend_matches_native_path and the mask test.
NATIVE_CASES = {
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
}


# ---------------------------------------------------------------------------------------------
# Tiny random HF model dirs for architectures the demo-model generator does not know
# ---------------------------------------------------------------------------------------------


def _init_random(model: torch.nn.Module) -> None:
    """Non-trivial weights with clear top-1 logit gaps (HF's default init gives near-flat logits)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    hidden = embed.shape[1]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param is head:  # also a tied embedding: logits std ~4
                param.normal_(0.0, 4.0 / math.sqrt(hidden))
            elif param is embed:
                param.normal_(0.0, 0.05)
            elif param.ndim == 1 and "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif param.ndim == 1:
                param.normal_(0.0, 0.1)
            else:  # [out_features, in_features]
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]))


def make_hf_model_dir(out_dir: Path, config_class: str, architecture: str, tokenizer_dir: str, **fields) -> str:
    """config.json + model.safetensors written by transformers, plus the demo tokenizer's files."""
    config = getattr(transformers, config_class)(**{**_SHAPE, **fields})
    return save_random_model(out_dir, config, architecture, tokenizer_dir, _init_random)


@pytest.fixture(scope="module")
def hf_model_dir(model_factory, tmp_path_factory):
    built: dict[str, str] = {}

    def make(case: str) -> str:
        if case not in built:
            config_class, architecture, fields = NON_NATIVE_CASES[case]
            out = tmp_path_factory.mktemp(f"hf-{case}")
            built[case] = make_hf_model_dir(out, config_class, architecture, model_factory("llama"), **fields)
        return built[case]

    return make


def _backend_model(llm: LLM) -> torch.nn.Module:
    return llm.engine.runner.model


# ---------------------------------------------------------------------------------------------
# Greedy parity with transformers' generate()
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_native_architectures_through_backend(model_factory, case):
    arch, overrides = NATIVE_CASES[case]
    llm = run_parity(model_factory(arch, **overrides), make_prompts(VOCAB_SIZE), max_num_batched_tokens=16,
                     num_kv_blocks=NUM_KV_BLOCKS, model_impl="transformers")
    assert isinstance(_backend_model(llm), TransformersForCausalLM)


@pytest.mark.parametrize("case", list(NON_NATIVE_CASES))
def test_non_native_architectures(hf_model_dir, case):
    """model_impl="auto" picks the backend for an architecture pdserve has no native code for."""
    llm = run_parity(hf_model_dir(case), make_prompts(VOCAB_SIZE, seed=4), max_num_batched_tokens=16,
                     num_kv_blocks=NUM_KV_BLOCKS)
    assert isinstance(_backend_model(llm), TransformersForCausalLM)


def test_chunked_prefill_and_prefix_hits(hf_model_dir):
    """A 7-token step budget splits long prompts into chunks mixed with decodes; repeats hit the cache."""
    llm = run_parity(hf_model_dir("gpt-neox"), make_prompts(VOCAB_SIZE, seed=1), max_num_batched_tokens=7,
                     num_kv_blocks=NUM_KV_BLOCKS)
    assert llm.engine.stats().prefix_cache_hits > 0


def test_backend_matches_native_path(model_factory):
    """Same Llama dir, same prompts: the same tokens and (nearly) the same logprobs either way."""
    model_dir = model_factory("llama")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(VOCAB_SIZE, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = {}
    for impl in ("native", "transformers"):
        llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=32,
                  num_kv_blocks=NUM_KV_BLOCKS, model_impl=impl)
        outputs[impl] = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.kv_cache_manager.num_used_blocks == 0
    assert isinstance(_backend_model(llm), TransformersForCausalLM)
    for native, backend in zip(outputs["native"], outputs["transformers"]):
        assert native.token_ids == backend.token_ids
        for ours, theirs, token in zip(native.logprobs, backend.logprobs, native.token_ids):
            assert abs(ours[token] - theirs[token]) < 1e-4


def test_transformers_builds_no_attention_mask(model_factory):
    """A step mixes several requests in one row; their separation comes from pdserve's metadata, so
    transformers must hand every attention layer mask=None rather than build a (T x T) mask."""
    llm = LLM(model_factory("llama"), dtype="float32", block_size=4, num_kv_blocks=NUM_KV_BLOCKS,
              model_impl="transformers")
    masks = []
    first_attention = llm.engine.runner.model.attention_layers[0]  # bound to HF layer 0's self_attn
    hf_attention = llm.engine.runner.model.hf_model.model.layers[0].self_attn
    assert hf_attention.pdserve_attention is first_attention
    hf_attention.register_forward_pre_hook(lambda m, args, kwargs: masks.append(kwargs["attention_mask"]),
                                           with_kwargs=True)
    llm.generate([{"prompt_token_ids": [7, 8, 9, 10, 11]}, {"prompt_token_ids": [12, 13]}],
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(masks) >= 3 and all(mask is None for mask in masks)


@pytest.mark.parametrize("case", ["phi3", "gemma"])
def test_disaggregated_non_native_equals_colocated(hf_model_dir, case, tmp_path):
    """Phi-3 and Gemma (auto -> backend) on real prefill and decode processes: D continues from the KV that P's
    backend computed and produces the colocated tokens (which match transformers: test_non_native_architectures);
    no block leaks on either side."""
    from pdserve.local_cluster import Driver
    from tests.decode.test_disaggregated import GREEDY, PROMPTS, assert_no_leaks, colocated_tokens, start_pair

    model_dir = hf_model_dir(case)
    expected = colocated_tokens(model_dir, PROMPTS, **GREEDY)
    prefill, decode = start_pair(model_dir, tmp_path)
    driver = Driver(decode, prefill)
    try:
        assert [r.token_ids for r in driver.generate(PROMPTS, **GREEDY)] == expected
        stats = driver.decode_stats()
        assert stats.num_kv_transfers_failed == 0 and stats.kv_bytes_received > 0
        assert_no_leaks(driver)
    finally:
        driver.close()
        prefill.stop()
        decode.stop()


# ---------------------------------------------------------------------------------------------
# Choosing the implementation
# ---------------------------------------------------------------------------------------------


def test_model_impl_resolution(model_factory, hf_model_dir):
    llama, phi3 = model_factory("llama"), hf_model_dir("phi3")
    assert resolve_model_class(ModelConfig.from_hf(llama)) is LlamaForCausalLM
    assert resolve_model_class(ModelConfig.from_hf(llama, model_impl="native")) is LlamaForCausalLM
    assert resolve_model_class(ModelConfig.from_hf(llama, model_impl="transformers")) is TransformersForCausalLM
    assert resolve_model_class(ModelConfig.from_hf(phi3)) is TransformersForCausalLM
    with pytest.raises(UnsupportedArchitectureError, match="'Phi3ForCausalLM' has no native.*LlamaForCausalLM"):
        resolve_model_class(ModelConfig.from_hf(phi3, model_impl="native"))
    with pytest.raises(ConfigError, match="model_impl='hf' is not a model implementation"):
        ModelConfig.from_hf(llama, model_impl="hf")


def test_native_on_non_native_arch_through_llm(hf_model_dir):
    with pytest.raises(UnsupportedArchitectureError, match="Phi3ForCausalLM.*supported|native"):
        LLM(hf_model_dir("phi3"), num_kv_blocks=8, model_impl="native")


def test_architecture_transformers_lacks(model_factory, tmp_path):
    model_dir = _copy(model_factory("llama"), tmp_path)
    _edit_config(model_dir, architectures=["FancyNewForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewForCausalLM.*transformers"):
        resolve_model_class(ModelConfig.from_hf(model_dir, model_impl="transformers"))


# ---------------------------------------------------------------------------------------------
# Features pdserve's attention cannot express
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class, architecture, fields, expected", [
    # BLOOM adds ALiBi biases in its own attention code, which never calls an AttentionInterface function
    ("BloomConfig", "BloomForCausalLM", {}, "computes attention itself"),
])
def test_unsupported_model_is_refused_at_load(tmp_path, config_class, architecture, fields, expected):
    """A named error before any weight is read (the dir holds only config.json)."""
    config = getattr(transformers, config_class)(**{**_SHAPE, **fields})
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelFeatureError, match=expected):
        load_model(ModelConfig.from_hf(tmp_path, dtype="float32"))


def test_feature_checks_name_each_feature():
    windowed = transformers.MistralConfig(**_SHAPE, sliding_window=64)
    assert unsupported_features(windowed) == []  # pdserve's attention has sliding windows
    bidirectional = transformers.GemmaConfig(**_SHAPE, use_bidirectional_attention=True)
    assert any("bidirectional" in f for f in unsupported_features(bidirectional))
    assert unsupported_features(transformers.LlamaConfig(**_SHAPE)) == []


# ---------------------------------------------------------------------------------------------
# Weights: every parameter exactly once, named errors otherwise
# ---------------------------------------------------------------------------------------------


def _copy(model_dir: str, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def _edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def _edit_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _load_backend(model_dir: Path) -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(model_dir, dtype="float32", model_impl="transformers"))


@pytest.mark.parametrize("problem, expected", [
    ("missing", "missing 1 tensor.*layers.1.mlp.down_proj.weight"),
    ("unexpected", "unexpected tensor model.layers.0.extra.weight"),
    ("misshaped", r"model.norm.weight has shape \(3,\), the model expects \(64,\)"),
])
def test_weight_errors(hf_model_dir, tmp_path, problem, expected):
    model_dir = _copy(hf_model_dir("olmo2"), tmp_path)
    edits = {
        "missing": lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
        "unexpected": lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
        "misshaped": lambda t: t.update({"model.norm.weight": torch.zeros(3)}),
    }
    _edit_weights(model_dir, edits[problem])
    with pytest.raises((ModelLoadError, ValueError), match=expected):
        _load_backend(model_dir)


def test_tied_weights_load_once(model_factory):
    """A tied lm_head is the embedding itself; the checkpoint holds it once and nothing is missing."""
    model = _load_backend(Path(model_factory("llama", tie_word_embeddings=True)))
    assert model.lm_head.weight is model.hf_model.get_input_embeddings().weight
    assert not any(p.is_meta for p in model.parameters())
