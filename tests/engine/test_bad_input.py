"""Bad input gets an error that names the problem; nothing crashes or leaks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, InvalidRequestError, SamplingParams
from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.layers.linear import WeightShapeError
from pdserve.engine.loader import ModelLoadError, resolve_model_dir
from pdserve.engine.models.registry import UnsupportedArchitectureError


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", num_kv_blocks=16)  # 256 token slots


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=4))


def test_prompt_plus_max_tokens_beyond_context(llm):
    with pytest.raises(InvalidRequestError, match="exceeds the model's context length of 512"):
        llm.generate({"prompt_token_ids": [5] * 500}, SamplingParams(max_tokens=20))


def test_request_larger_than_kv_cache(llm):
    with pytest.raises(InvalidRequestError, match="larger KV cache"):
        llm.generate({"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=200))


def test_token_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 1024]}, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_non_positive_max_tokens(max_tokens):
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n=0"), ({"n": 257}, "n=257"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logprobs": 99}, "logprobs"),
])
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(InvalidRequestError, match=word):
        SamplingParams(**kwargs)


def test_nothing_leaks_after_rejected_requests(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.kv_cache_manager.num_used_blocks == 0


def _copy_model(model_factory, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model_factory("llama"), target)
    return target


def test_unknown_architecture(model_factory, tmp_path):
    model_dir = _copy_model(model_factory, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("content", [b'{"architectures": [', b"[]", b"\xff\xfe{}"])
def test_a_broken_json_file_of_the_model_is_named(model_factory, tmp_path, name, content):
    model = tmp_path / "model"
    shutil.copytree(model_factory(), model)
    (model / name).write_bytes(content)
    with pytest.raises(ConfigError, match=f"{name}.*restore the model directory's file"):
        ModelConfig.from_hf(model)


def test_not_a_model_or_hub_id(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist and is not a Hugging Face hub id"):
        resolve_model_dir(str(tmp_path / "missing" / "deeper"))
    with pytest.raises(ModelLoadError, match="pass a model directory"):
        LLM("path/to/hf-model-dir")  # a placeholder copied from an example: one line, no hub lookup


def test_unreachable_hub_id_is_described_as_a_hub_model():
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    from pdserve.engine.hub import hub_failure

    offline = LocalEntryNotFoundError("Cannot find the requested files in the disk cache")
    assert hub_failure("org/name", "the model", offline).startswith(
        "cannot reach the Hugging Face hub to fetch the model of 'org/name'")
    missing = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its constructor wants an HTTP response
    assert "has no model 'org/name'" in hub_failure("org/name", "the model", missing)
    wrapped = OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    assert "cannot reach the Hugging Face hub" in hub_failure("org/name", "the tokenizer", wrapped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_cuda_device_without_cuda_names_the_fix(model_factory):
    with pytest.raises(ConfigError, match="use --device cpu"):
        LLM(model_factory("llama"), device="cuda")
    with pytest.raises(ConfigError, match="is not a device"):
        ModelConfig.from_hf(model_factory("llama"), device="gpu0")


def test_missing_safetensors(model_factory, tmp_path):
    model_dir = _copy_model(model_factory, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_truncated_safetensors(model_factory, tmp_path):
    model_dir = _copy_model(model_factory, tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        LLM(str(model_dir), num_kv_blocks=8)


def _rewrite_weights(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor(model_factory, tmp_path):
    model_dir = _copy_model(model_factory, tmp_path)
    _rewrite_weights(model_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_unexpected_tensor(model_factory, tmp_path):
    model_dir = _copy_model(model_factory, tmp_path)
    _rewrite_weights(model_dir, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(ModelLoadError, match="unexpected tensor model.layers.0.extra.weight"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_mis_shaped_tensor(model_factory, tmp_path):
    model_dir = _copy_model(model_factory, tmp_path)
    _rewrite_weights(model_dir, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(WeightShapeError, match=r"model.norm.weight has shape \(3,\), the model expects \(64,\)"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_bad_dtype(model_factory):
    with pytest.raises(ConfigError, match="dtype='int8' is not supported"):
        LLM(model_factory("llama"), dtype="int8")


def test_sliding_window_does_not_cap_the_context(model_factory):
    model_dir = model_factory("mistral", sliding_window=64)
    config = ModelConfig.from_hf(model_dir)
    assert config.max_model_len == config.max_position_embeddings == 512
    assert ModelConfig.from_hf(model_dir, max_model_len=128).max_model_len == 128
    assert [config.sliding_window_of(i) for i in range(config.num_layers)] == [64] * config.num_layers


def test_a_hub_id_without_a_resolvable_hub_fails_at_once(monkeypatch, tmp_path):
    """No DNS (an offline machine): the local HF cache alone is asked, so the error comes in seconds rather
    than after huggingface_hub's minute of retries; no request leaves the machine."""
    import socket

    from pdserve.engine.loader import ModelLoadError, resolve_model_dir
    from pdserve.engine.tokenizer import TokenizerLoadError, load_tokenizer

    lookups = []

    def no_dns(host, *args, **kwargs):
        lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    with pytest.raises(TokenizerLoadError, match="cannot reach the Hugging Face hub"):
        load_tokenizer("someorg/no-such-model")
    with pytest.raises(ModelLoadError, match="cannot reach the Hugging Face hub"):
        resolve_model_dir("someorg/no-such-model")
    # one look per fetch (and one of transformers' own, which it does not retry); the hub client's retries
    # looked the host up five times per file
    assert 2 <= len(lookups) <= 3 and set(lookups) == {"huggingface.co"}, lookups


def _edit_json(path, edit):
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


@pytest.mark.parametrize("field, value, word", [
    ("num_attention_heads", None, "has no `num_attention_heads`"),  # None: the field is deleted
    ("num_hidden_layers", "two", "`num_hidden_layers` is 'two', not a positive integer"),
    ("max_position_embeddings", 0, "`max_position_embeddings` is 0, not a positive integer"),
    ("vocab_size", -5, "`vocab_size` is -5"),
])
def test_a_config_field_missing_or_not_a_count_is_named(model_factory, tmp_path, field, value, word):
    """Was a bare KeyError traceback, "invalid literal for int() with base 10: 'two'", or (for 0) an engine that
    refused every request for its context of 0 tokens."""
    model_dir = _copy_model(model_factory, tmp_path)
    _edit_json(model_dir / "config.json", lambda c: c.pop(field) if value is None else c.update({field: value}))
    with pytest.raises(ConfigError, match=f"config.json.*{word}.*restore the model directory's config.json"):
        ModelConfig.from_hf(model_dir)


@pytest.mark.parametrize("eos", ["x", [1, None], True])
def test_an_eos_token_id_that_is_no_token_id_is_named(model_factory, tmp_path, eos):
    """Was "invalid literal for int()" at load, or a sampling_params error on every request."""
    model_dir = _copy_model(model_factory, tmp_path)
    _edit_json(model_dir / "generation_config.json", lambda c: c.update({"eos_token_id": eos}))
    with pytest.raises(ConfigError, match="generation_config.json: `eos_token_id` is .*not a token id"):
        ModelConfig.from_hf(model_dir)


@pytest.mark.parametrize("max_model_len", [0, -3])
def test_a_max_model_len_below_one_is_refused(model_factory, max_model_len):
    """Was accepted: the engine then failed its registration ("register.max_model_len=0 is out of bounds")."""
    with pytest.raises(ConfigError, match=f"max_model_len={max_model_len} must be at least 1 token.*512"):
        ModelConfig.from_hf(model_factory("llama"), max_model_len=max_model_len)


def test_a_max_model_len_beyond_the_model_does_not_blame_a_sliding_window(model_factory):
    with pytest.raises(ConfigError, match="max_position_embeddings = 512") as refused:
        ModelConfig.from_hf(model_factory("llama"), max_model_len=100_000)
    assert "sliding" not in str(refused.value), "this model has no sliding window"


def test_integer_weights_are_refused_not_cast(model_factory, tmp_path):
    """An int32 tensor in a float model (a quantized or broken checkpoint) was cast and loaded as garbage."""
    model_dir = _copy_model(model_factory, tmp_path)
    _rewrite_weights(model_dir, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))
    with pytest.raises(ModelLoadError, match="tensor model.norm.weight is int32, not a floating-point weight"):
        LLM(str(model_dir), num_kv_blocks=8)


def test_a_directory_without_tokenizer_files_says_so_in_one_line(model_factory, tmp_path):
    """Was transformers' multi-line error about sentencepiece and tiktoken."""
    from pdserve.engine.tokenizer import TokenizerLoadError, load_tokenizer

    model_dir = _copy_model(model_factory, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model_dir / name).unlink(missing_ok=True)
    with pytest.raises(TokenizerLoadError, match="holds no tokenizer .tokenizer.json, tokenizer.model, vocab.json.: "
                                                 "copy") as refused:
        load_tokenizer(model_dir)
    assert "\n" not in str(refused.value) and "sentencepiece" not in str(refused.value)
