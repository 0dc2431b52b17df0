"""Demo models: real HF dirs that transformers loads, with the shapes, tokenizer and chat template
asked for, deterministic per seed, and random enough that greedy text is not one repeated token."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pdserve import demo_model
from pdserve.demo_model import (
    BOS_TOKEN,
    DEMO_MODEL_VERSION,
    DEMO_SIZES,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    SUPPORTED_DEMO_ARCHS,
    default_demo_model,
    demo_config,
    demo_tokenizer,
    make_demo_model,
)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
MULTIBYTE_TEXT = "héllo wörld 日本 🙂 — naïve café"
PROMPTS = ["The quick brown fox", "def main():\n    return", "Hello", "héllo wörld 日本 🙂"]


@pytest.fixture(scope="module", autouse=True)
def demo_cache(tmp_path_factory):
    """Every test in this file caches tokenizers and models under a fresh PDSERVE_CACHE."""
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("pdserve-cache")
        mp.setenv("PDSERVE_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, demo_cache) -> dict[str, Path]:
    """One tiny seed-0 model per arch, built once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_demo_model(root / arch, arch=arch, size="tiny") for arch in SUPPORTED_DEMO_ARCHS}


def _greedy(model_dir: Path, prompt: str, num_tokens: int = 20) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, num_prompt_tokens]
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    return out[0, input_ids.shape[1]:].tolist()


# ---------------------------------------------------------------------------------------------
# Files and loading
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_tiny_dir_has_every_file_and_loads_in_transformers(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (model_dir / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == ARCHITECTURES[arch]
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [ARCHITECTURES[arch]]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == model.config.vocab_size == 1024
    assert Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size() == 1024


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_tiny_config_has_the_tiny_shape(tiny_dirs, arch):
    config = AutoConfig.from_pretrained(tiny_dirs[arch])
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings is False


def test_arch_specific_features(tiny_dirs):
    llama = load_file(tiny_dirs["llama"] / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" not in llama
    qwen2 = load_file(tiny_dirs["qwen2"] / "model.safetensors")
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].shape == (4 * 16,)
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].shape == (2 * 16,)
    qwen3_config = AutoConfig.from_pretrained(tiny_dirs["qwen3"])
    assert qwen3_config.head_dim == 32 != qwen3_config.hidden_size // qwen3_config.num_attention_heads
    qwen3 = load_file(tiny_dirs["qwen3"] / "model.safetensors")
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    mistral_config = AutoConfig.from_pretrained(tiny_dirs["mistral"])
    assert mistral_config.sliding_window > mistral_config.max_position_embeddings


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_every_weight_is_random_so_a_loader_that_skips_one_is_caught(tiny_dirs, arch):
    # HF's own init leaves norms at one and biases at zero; ours must not.
    for name, tensor in load_file(tiny_dirs[arch] / "model.safetensors").items():
        assert tensor.dtype == torch.float32, name
        assert torch.isfinite(tensor).all(), name
        assert not torch.all(tensor == 1), f"{name} is all ones"
        assert not torch.all(tensor == 0), f"{name} is all zeros"
        assert tensor.std() > 0, name


# ---------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Hello, world! def f(x): return x ** 2\n\ttabs  and  spaces", MULTIBYTE_TEXT])
def test_tokenizer_round_trips_text(tiny_dirs, text):
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert hf_tokenizer.decode(ids) == text
    raw = Tokenizer.from_file(str(tiny_dirs["llama"] / "tokenizer.json"))
    assert raw.encode(text).ids == ids
    assert raw.decode(raw.encode(text).ids) == text


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_transformers_and_tokenizers_encode_alike_for_every_arch(tiny_dirs, arch):
    # transformers 5 rebuilds the pipeline for model_type "qwen2"; ours must equal what it builds.
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    raw = Tokenizer.from_file(str(tiny_dirs[arch] / "tokenizer.json"))
    texts = (MULTIBYTE_TEXT, "  x = 1234567\n\n\tdef f():  ", "I'm sure they'll say \"don't\"", "e\u0301 cafe\u0301")
    for text in texts:
        assert hf_tokenizer(text, add_special_tokens=False).input_ids == raw.encode(text).ids, text
    # NFC like Qwen2's tokenizer: decomposed accents come back composed.
    assert raw.decode(raw.encode("cafe\u0301").ids) == "caf\u00e9"


def test_tokenizer_special_tokens_match_the_config(tiny_dirs):
    model_dir = tiny_dirs["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert tokenizer.bos_token_id == config.bos_token_id == generation["bos_token_id"] == 0
    assert tokenizer.eos_token_id == config.eos_token_id == generation["eos_token_id"] == 1
    assert tokenizer.pad_token_id == config.pad_token_id == generation["pad_token_id"] == 2
    for token in (IM_START_TOKEN, IM_END_TOKEN):
        assert len(tokenizer(token, add_special_tokens=False).input_ids) == 1
    # No BOS is added implicitly: the chat template supplies it.
    assert tokenizer("hi").input_ids == tokenizer("hi", add_special_tokens=False).input_ids


def test_every_id_decodes(tiny_dirs):
    tokenizer = Tokenizer.from_file(str(tiny_dirs["llama"] / "tokenizer.json"))
    for token_id in range(tokenizer.get_vocab_size()):
        assert tokenizer.id_to_token(token_id) is not None, token_id
    assert isinstance(tokenizer.decode(list(range(1024)), skip_special_tokens=False), str)


def test_chat_template_renders_a_conversation_with_generation_prompt(tiny_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi 🙂"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids(IM_START_TOKEN)]


def test_tokenizer_is_trained_once_per_process(monkeypatch):
    demo_tokenizer(1024)

    def fail(vocab_size):
        raise AssertionError("tokenizer retrained")

    monkeypatch.setattr(demo_model, "_train_tokenizer", fail)
    assert demo_tokenizer(1024).get_vocab_size() == 1024


def test_tokenizer_is_read_from_the_disk_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "_tokenizer_json_by_vocab", {})
    first = demo_tokenizer(1024).to_str()  # trained, then written to the (empty) disk cache
    monkeypatch.setattr(demo_model, "_tokenizer_json_by_vocab", {})
    monkeypatch.setattr(demo_model, "_train_tokenizer", lambda vocab_size: pytest.fail("retrained"))
    assert demo_tokenizer(1024).to_str() == first


def test_tokenizer_training_is_deterministic(monkeypatch, tmp_path):
    first = demo_tokenizer(1024).to_str()
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "_tokenizer_json_by_vocab", {})
    assert demo_tokenizer(1024).to_str() == first
    assert (tmp_path / "demo-tokenizers").is_dir()  # trained afresh, not read from the old cache


def test_small_corpus_is_padded_with_reserved_tokens(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "_tokenizer_json_by_vocab", {})
    monkeypatch.setattr(demo_model, "_corpus_texts", lambda max_bytes: iter(["tiny corpus, few merges"] * 3))
    tokenizer = demo_tokenizer(400)
    assert tokenizer.get_vocab_size() == 400
    assert tokenizer.id_to_token(399).startswith("<|reserved_")
    assert tokenizer.decode(tokenizer.encode(MULTIBYTE_TEXT).ids) == MULTIBYTE_TEXT


# ---------------------------------------------------------------------------------------------
# Overrides, sizes, dtypes, bad input
# ---------------------------------------------------------------------------------------------


def test_config_overrides_are_applied(tmp_path):
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 128}
    overrides = {"tie_word_embeddings": True, "attention_bias": True, "rope_scaling": llama3_rope,
                 "head_dim": 8, "num_key_value_heads": 1, "vocab_size": 700}
    model_dir = make_demo_model(tmp_path / "m", arch="llama", config_overrides=overrides)
    config = AutoConfig.from_pretrained(model_dir)
    assert config.tie_word_embeddings is True
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (8, 1, 700)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["rope_theta"] == 10000.0
    weights = load_file(model_dir / "model.safetensors")
    assert weights["model.layers.0.self_attn.k_proj.bias"].shape == (8,)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 64)
    assert "lm_head.weight" not in weights  # tied
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 700
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_mistral_sliding_window_can_be_overridden():
    assert demo_config("mistral", "tiny", {"sliding_window": 64}).sliding_window == 64
    assert demo_config("mistral", "tiny", {"max_position_embeddings": 4096}).sliding_window > 4096


@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_small_config_is_smollm_shaped(arch):
    config = demo_config(arch, "small")
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 2048)
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.architectures == [ARCHITECTURES[arch]]


def test_bfloat16_weights(tmp_path):
    model_dir = make_demo_model(tmp_path / "bf16", arch="qwen3", dtype="bfloat16")
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(model_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    fp32 = load_file(make_demo_model(tmp_path / "fp32", arch="qwen3") / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(weights[name], fp32[name].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"arch": "gpt2"}, "llama, qwen2, qwen3, mistral"), ({"size": "huge"}, "tiny, small"),
     ({"dtype": "int8"}, "float32, bfloat16, float16"), ({"config_overrides": {"vocab_size": 100}}, "at least 261")],
)
def test_bad_choices_raise_value_error_naming_the_allowed_values(tmp_path, kwargs, named):
    with pytest.raises(ValueError, match=named):
        make_demo_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_default_demo_model_rejects_bad_choices():
    with pytest.raises(ValueError, match="tiny, small"):
        default_demo_model("llama", "medium")
    assert set(DEMO_SIZES) == {"tiny", "small"}


# ---------------------------------------------------------------------------------------------
# Determinism and generation
# ---------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path, tiny_dirs):
    again = make_demo_model(tmp_path / "again", arch="qwen2", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_dirs["qwen2"] / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny_dirs["qwen2"] / "tokenizer.json").read_bytes()
    other = load_file(make_demo_model(tmp_path / "other", arch="qwen2", seed=1) / "model.safetensors")
    base = load_file(again / "model.safetensors")
    assert base.keys() == other.keys()
    assert all(not torch.equal(base[name], other[name]) for name in base)


def test_building_leaves_the_callers_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    make_demo_model(tmp_path / "m", arch="llama", seed=7)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", SUPPORTED_DEMO_ARCHS)
def test_greedy_generation_is_not_degenerate(tmp_path, tiny_dirs, arch, tie):
    model_dir = tiny_dirs[arch] if not tie else make_demo_model(
        tmp_path / "tied", arch=arch, config_overrides={"tie_word_embeddings": True})
    outputs = [_greedy(model_dir, prompt) for prompt in PROMPTS]
    assert all(len(out) == 20 for out in outputs)
    for prompt, out in zip(PROMPTS, outputs):
        assert len(set(out)) > 1, f"{prompt!r} -> one repeated token {out}"
    assert len({tuple(out) for out in outputs}) == len(PROMPTS), "different prompts gave the same text"


# ---------------------------------------------------------------------------------------------
# default_demo_model cache
# ---------------------------------------------------------------------------------------------


def test_default_demo_model_is_built_once_then_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    first = default_demo_model("qwen3", "tiny")
    assert first == tmp_path / "demo-models" / f"qwen3-tiny-{DEMO_MODEL_VERSION}"
    assert AutoConfig.from_pretrained(first).architectures == ["Qwen3ForCausalLM"]
    monkeypatch.setattr(demo_model, "make_demo_model", lambda *a, **k: pytest.fail("rebuilt"))
    assert default_demo_model("qwen3", "tiny") == first
    assert sorted(p.name for p in (tmp_path / "demo-models").iterdir()) == [f"qwen3-tiny-{DEMO_MODEL_VERSION}"]


def test_default_demo_model_uses_the_copy_of_a_process_that_won_the_race(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    target = tmp_path / "demo-models" / f"llama-tiny-{DEMO_MODEL_VERSION}"
    real_make = demo_model.make_demo_model

    def make_while_another_process_finishes(out_dir, **kwargs):
        real_make(out_dir, **kwargs)
        target.mkdir()  # the other process renamed its copy into place first
        (target / "winner").write_text("")
        return Path(out_dir)

    monkeypatch.setattr(demo_model, "make_demo_model", make_while_another_process_finishes)
    assert default_demo_model("llama", "tiny") == target
    assert (target / "winner").exists()
    assert [p.name for p in target.parent.iterdir()] == [f"llama-tiny-{DEMO_MODEL_VERSION}"]  # our temp dir is gone


def test_small_demo_model_stops_at_a_sensible_length_by_default(tmp_path, monkeypatch):
    """Random weights never emit the end token: generation_config's max_new_tokens bounds a request that
    sets no max_tokens (the router and the offline API take it as the default)."""
    from pdserve.demo_model import _MAX_NEW_TOKENS
    from pdserve.engine.generation_defaults import load_generation_defaults

    assert 0 < _MAX_NEW_TOKENS["small"] <= 512
    assert load_generation_defaults(make_demo_model(tmp_path / "tiny")).max_tokens is None, "tests' tiny: none"
    monkeypatch.setitem(_MAX_NEW_TOKENS, "tiny", _MAX_NEW_TOKENS["small"])  # the small build's path, tiny-sized
    written = make_demo_model(tmp_path / "bounded")
    assert load_generation_defaults(written).max_tokens == _MAX_NEW_TOKENS["small"]


def test_demo_build_shows_no_transformers_shard_bar(tmp_path, capfd):
    make_demo_model(tmp_path / "m", arch="llama", size="tiny", progress=True)
    err = capfd.readouterr().err
    assert "Writing model shards" not in err


def test_demo_build_prints_a_line_per_phase_when_output_is_no_terminal(tmp_path):
    """As the first `pdserve up` builds it with its output in a log: each phase named, with the time left."""
    code = ("import sys; from pdserve.demo_model import make_demo_model; "
            "make_demo_model(sys.argv[1], arch='llama', size='tiny', progress=True)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True,
                          timeout=300, check=True)
    lines = done.stderr.splitlines()
    phases = [line for line in lines if line.startswith("[pdserve] building the llama-tiny demo model [")]
    assert len(phases) == 3 and "[1/3] random weights (" in phases[0] and "/3] writing model.safetensors (" in phases[1], done.stderr
    assert phases[0].endswith("(time left not known yet)") and re.search(r"\(about \d+s left\)$", phases[2])
    assert re.fullmatch(r"\[pdserve\] built the llama-tiny demo model in \d+s", lines[-1]), done.stderr
    assert "\r" not in done.stderr  # no bar redrawn in a log
