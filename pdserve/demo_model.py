"""Random-weight demo models written as real Hugging Face model directories.

Weights cannot be downloaded in tests or CI, so tests and the demo build their own model repos:
config.json, model.safetensors, generation_config.json, and a byte-level BPE tokenizer with a
ChatML-like chat template. Same arch, size, seed, overrides and dtype -> byte-identical weights.
The tokenizer is trained on the Python standard library's own source, so it is the same on every
machine with the same Python release. It NFC-normalises text like Qwen2's tokenizer, so any
NFC text round-trips through encode/decode.

    make_demo_model(out_dir, arch="llama", size="tiny", seed=0)   # a fresh dir for a test
    default_demo_model("llama", "small")                          # built once, cached on disk

The tokenizer adds no BOS by itself; the chat template starts with bos_token (as Llama 3's does),
so chat prompts carry one BOS whether or not the caller asks for special tokens.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

SUPPORTED_DEMO_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
DEMO_SIZES = ("tiny", "small")
DEMO_DTYPES = ("float32", "bfloat16", "float16")
# Bump when anything that changes the written files changes, so stale caches are not reused.
DEMO_MODEL_VERSION = "v2"
# generation_config.json's max_new_tokens per size: a request without max_tokens stops there (random
# weights never emit the end token, so it would otherwise run to the context length)
_MAX_NEW_TOKENS = {"small": 256}

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Ids 0..4 in this order in every demo tokenizer.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
NUM_BYTE_TOKENS = 256

# ChatML-like; `content` may be a string or a list of OpenAI-style {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# HF architecture name and config class name per demo arch, plus arch-specific config fields.
_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {"rms_norm_eps": 1e-5}),
    # Qwen2 always has q/k/v bias; its config has no flag for it.
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"rms_norm_eps": 1e-6, "use_sliding_window": False}),
    # Qwen3 has q/k RMSNorm built in; head_dim is explicit (set per size below).
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"rms_norm_eps": 1e-6, "use_sliding_window": False}),
    # sliding_window is set by _config_fields so that it never engages unless overridden.
    "mistral": ("MistralForCausalLM", "MistralConfig", {"rms_norm_eps": 1e-5}),
}

_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    },
    # Shaped like SmolLM-135M.
    "small": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
}
# Qwen3's explicit head_dim; for tiny it deliberately differs from hidden_size / num_heads (16).
_QWEN3_HEAD_DIM = {"tiny": 32, "small": 64}

# Random init (our own, not HF's): HF's default (std 0.02, norms at one, biases at zero) gives a
# tiny model near-flat logits whose greedy output is one repeated token, and would let a loader that
# skips norm weights or biases pass every test. Here every parameter is random and non-trivial:
# linear weights std 1/sqrt(fan_in) (each layer adds O(1) to the residual), small embeddings (so a
# tied lm_head does not just predict the input token again), and the final norm / lm_head scaled so
# logits have std ~_LOGIT_STD (clear gaps between the top logits, so greedy output is stable).
_EMBED_STD = 0.05
_LOGIT_STD = 4.0
_BIAS_STD = 0.1
_NORM_WEIGHT_RANGE = (0.5, 1.5)


# ---------------------------------------------------------------------------------------------
# Validation and config
# ---------------------------------------------------------------------------------------------


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown demo model {name} {value!r}: pick one of {', '.join(allowed)}")


def _config_fields(arch: str, size: str, config_overrides: dict[str, Any]) -> dict[str, Any]:
    """Size, arch and special-token fields, with the overrides applied last."""
    fields = {
        **_SIZES[size],
        **_ARCHS[arch][2],
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }
    if arch == "qwen3":
        fields["head_dim"] = _QWEN3_HEAD_DIM[size]
    fields.update(config_overrides)
    if arch == "mistral" and "sliding_window" not in config_overrides:
        # Past the longest possible sequence, so the window never engages.
        fields["sliding_window"] = 2 * fields["max_position_embeddings"]
    return fields


def _check_vocab_size(vocab_size: int) -> None:
    min_vocab = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer: "
            f"use at least {min_vocab} ({NUM_BYTE_TOKENS} bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )


def demo_config(
    arch: str = "llama",
    size: str = "tiny",
    config_overrides: dict[str, Any] | None = None,
    dtype: str = "float32",
):
    """The transformers config of a demo model (no weights, no tokenizer): cheap for any size."""
    _check_choice("arch", arch, SUPPORTED_DEMO_ARCHS)
    _check_choice("size", size, DEMO_SIZES)
    _check_choice("dtype", dtype, DEMO_DTYPES)
    import transformers

    architecture, config_class_name, _ = _ARCHS[arch]
    fields = _config_fields(arch, size, dict(config_overrides or {}))
    _check_vocab_size(fields["vocab_size"])
    config = getattr(transformers, config_class_name)(**fields)
    config.architectures = [architecture]
    config.dtype = dtype
    return config


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE trained on the standard library's source, cached per vocab size
# ---------------------------------------------------------------------------------------------

# Folders of the standard library left out of the corpus: tests, GUI tools, installed packages.
_CORPUS_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo",
     "ensurepip", "__pycache__"}
)
# The pipeline is NFC, then this split (contractions, letter runs, single digits, punctuation runs,
# newlines, spaces), then byte-level. It must equal what transformers 5 rebuilds for model_type
# "qwen2" (its Qwen2Tokenizer ignores the pipeline in tokenizer.json and keeps only vocab and merges),
# so that AutoTokenizer and tokenizers.Tokenizer.from_file encode alike for every arch.
_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
# A small vocabulary needs little text: train on about this many bytes per token (the "small"
# vocabulary takes the whole corpus, ~10 MB; "tiny" a few files, so it trains in well under a second).
_CORPUS_BYTES_PER_TOKEN = 256
_tokenizer_json_by_vocab: dict[int, str] = {}


def cache_dir() -> Path:
    """pdserve's cache root: $PDSERVE_CACHE, else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def _corpus_files() -> list[Path]:
    """Sorted .py files of the standard library (same list on every machine with this Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Prune in place so os.walk never enters site-packages, tests and the like.
        subfolders[:] = [d for d in subfolders if d not in _CORPUS_SKIP_DIRS and not d.startswith("config-")]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    if not files:
        raise RuntimeError(f"no Python sources under {root} to train the demo tokenizer on: "
                           "install the Python standard library sources")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _corpus_texts(max_bytes: int):
    """Texts of an evenly spread subset of _corpus_files() of about max_bytes (all if larger)."""
    files = _corpus_files()
    total_bytes = sum(path.stat().st_size for path in files)
    stride = max(1, total_bytes // max_bytes)
    for path in files[::stride]:
        yield path.read_text(encoding="utf-8", errors="replace")


def _train_tokenizer(vocab_size: int):
    """Byte-level BPE with SPECIAL_TOKENS at ids 0.., padded with reserved tokens to vocab_size."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_texts(vocab_size * _CORPUS_BYTES_PER_TOKEN), trainer)
    num_reserved = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens(
        [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(num_reserved)]
    )
    return tokenizer


def _tokenizer_cache_path(vocab_size: int) -> Path:
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir() / "demo-tokenizers" / f"bpe-{vocab_size}-{py}-{DEMO_MODEL_VERSION}.json"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def demo_tokenizer(vocab_size: int):
    """The demo `tokenizers.Tokenizer` with exactly vocab_size ids; trained once per process and
    cache dir (kept in memory and under $PDSERVE_CACHE/demo-tokenizers)."""
    from tokenizers import Tokenizer

    if vocab_size not in _tokenizer_json_by_vocab:
        path = _tokenizer_cache_path(vocab_size)
        if path.is_file():
            text = path.read_text(encoding="utf-8")
        else:
            text = _train_tokenizer(vocab_size).to_str()
            _write_atomic(path, text)
        _tokenizer_json_by_vocab[vocab_size] = text
    return Tokenizer.from_str(_tokenizer_json_by_vocab[vocab_size])


def _save_tokenizer(out_dir: Path, vocab_size: int, max_length: int) -> None:
    """tokenizer.json plus the config files AutoTokenizer reads (transformers 4.x and 5.x alike)."""
    demo_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
               "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN]}
    # unk_token null: byte-level needs none, and without it transformers' Qwen2Tokenizer would add
    # its default "<|endoftext|>" as an extra id past vocab_size.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def _init_weights(model, config) -> None:
    """Re-initialise every parameter in place, in named_parameters() order (deterministic)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            _init_param(name, param)
        if config.tie_word_embeddings:
            # logits = embed_tokens @ (norm weight * unit-rms hidden): lift the norm to _LOGIT_STD.
            model.model.norm.weight.mul_(_LOGIT_STD / (_EMBED_STD * math.sqrt(config.hidden_size)))


def _init_param(name: str, param) -> None:
    if param.ndim == 1 and "norm" in name:
        param.uniform_(*_NORM_WEIGHT_RANGE)
    elif param.ndim == 1:
        param.normal_(0.0, _BIAS_STD)
    elif "embed_tokens" in name:
        param.normal_(0.0, _EMBED_STD)
    elif "lm_head" in name:  # [vocab_size, hidden_size]
        param.normal_(0.0, _LOGIT_STD / math.sqrt(param.shape[1]))
    else:  # [out_features, in_features]
        param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]))


def _build_model(config, seed: int, dtype: str):
    """Random-init causal LM in float32 under `seed`, then cast to dtype; the caller's RNG state
    is left alone."""
    import torch
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _init_weights(model, config)
    return model.to(getattr(torch, dtype)).eval()


def _save_model(model, config, out_dir: Path, max_new_tokens: int | None) -> None:
    import transformers
    from transformers.utils import logging as hf_logging

    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        max_new_tokens=max_new_tokens,
    )
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # our own bar covers the whole build
    try:  # one file whatever the size: the loader and tests expect model.safetensors
        model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="1000GB")
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    # safetensors >= 0.8 writes 0600; other users of a shared cache must be able to read it.
    os.chmod(out_dir / "model.safetensors", 0o644)


def make_demo_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    dtype: str = "float32",
    progress: bool = False,
) -> Path:
    """Write a random-weight HF model dir (config, safetensors, generation config, tokenizer, chat
    template) to out_dir, creating it; files already there are overwritten. Returns the dir.
    progress=True shows one progress bar (on stderr) over the build's steps."""
    from pdserve.progress import Progress, format_seconds

    config = demo_config(arch, size, config_overrides, dtype)
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    shown = sys.stderr if progress else io.StringIO()
    with Progress(3, f"[pdserve] building the {arch}-{size} demo model", file=shown) as bar:
        bar.start("random weights")
        model = _build_model(config, seed, dtype)
        bar.finish()
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
        bar.start(f"writing model.safetensors ({size_mb:.0f} MB)")
        _save_model(model, config, out_path, _MAX_NEW_TOKENS.get(size))
        bar.finish()
        bar.start("tokenizer")
        _save_tokenizer(out_path, config.vocab_size, config.max_position_embeddings)
        bar.finish()
    if progress and not bar.tty:
        took = format_seconds(time.monotonic() - bar.started)
        print(f"[pdserve] built the {arch}-{size} demo model in {took}", file=sys.stderr, flush=True)
    return out_path


def write_demo_model(out_dir: str | os.PathLike, arch: str, size: str, seed: int, force: bool = False) -> Path:
    """`pdserve demo-model DIR`: refuses a directory that already holds files unless force is given."""
    out_path = Path(out_dir).expanduser()
    if out_path.exists() and not out_path.is_dir():
        raise FileExistsError(f"{out_path} is a file: give a directory path for the model")
    if out_path.is_dir() and any(out_path.iterdir()) and not force:
        raise FileExistsError(f"{out_path} is not empty: choose a new directory, or pass --force to overwrite "
                              "the model files in it")
    return make_demo_model(out_path, arch=arch, size=size, seed=seed, progress=True)


def run_demo_model_command(args) -> str:
    """`pdserve demo-model`'s work; returns the line to print."""
    target = Path(args.dir).expanduser()
    if args.for_model is not None and Path(args.for_model).expanduser() != target:
        return f"not building the demo model: the services use {args.for_model}"
    if args.if_missing:
        if not build_once(target, args.arch, args.size, args.seed):
            return f"demo model already in {target}: kept"
    else:
        write_demo_model(target, args.arch, args.size, args.seed, force=args.force)
    return f"wrote {args.arch}-{args.size} demo model to {target}"


def is_model_dir(path: Path) -> bool:
    """A finished model directory: what the loader and tokenizer need is all there."""
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def build_once(out_dir: str | os.PathLike, arch: str, size: str, seed: int) -> bool:
    """`pdserve demo-model DIR --if-missing`: build into a temp sibling and rename it into place, so DIR
    is either absent or complete; False when a finished model is already there (kept as it is)."""
    target = Path(out_dir).expanduser()
    if is_model_dir(target):
        return False
    if target.is_dir() and any(target.iterdir()):
        raise FileExistsError(f"{target} holds files but no finished model: empty it, or pass --force instead "
                              "of --if-missing")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        make_demo_model(tmp, arch=arch, size=size, seed=seed, progress=True)
        if target.is_dir():
            target.rmdir()  # empty (a mount point is never the target: it is DIR's parent)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def default_demo_model(arch: str = "llama", size: str = "small") -> Path:
    """The seed-0 demo model for (arch, size), built once under $PDSERVE_CACHE/demo-models.

    Safe when several processes race: each builds in its own temp dir and renames it into place;
    a process that loses the race uses the winner's copy.
    """
    _check_choice("arch", arch, SUPPORTED_DEMO_ARCHS)
    _check_choice("size", size, DEMO_SIZES)
    target = cache_dir() / "demo-models" / f"{arch}-{size}-{DEMO_MODEL_VERSION}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        make_demo_model(tmp, arch=arch, size=size, seed=0, progress=True)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
