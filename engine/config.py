"""Frozen configuration built once per process: the model's shape, the KV cache and the scheduler."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Which model code runs: auto = native when pdserve has it, else the transformers backend.
MODEL_IMPLS = ("auto", "native", "transformers")


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the setting and how to fix it."""


def check_device(device: str | torch.device) -> torch.device:
    """The device, or a ConfigError naming the fix: a CUDA device needs a CUDA build of torch and a GPU."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={str(device)!r} is not a device: use cpu, cuda or cuda:N") from exc
    if resolved.type != "cuda" or torch.cuda.is_available():
        return resolved
    if torch.version.cuda is None:
        raise ConfigError(f"device={str(device)!r}, but this torch ({torch.__version__}) is a CPU-only build: use "
                          f"--device cpu, or install a CUDA build of torch (e.g. `pip install torch=="
                          f"{torch.__version__.split('+')[0]}` from PyPI on Linux)")
    raise ConfigError(f"device={str(device)!r}, but torch sees no CUDA GPU (check the driver and "
                      f"CUDA_VISIBLE_DEVICES): use --device cpu, or run where a GPU is visible")


def _cpu_capability() -> dict:
    """torch's own probe of this CPU's instruction sets ({} where torch cannot tell)."""
    try:
        return torch._C._cpu._get_cpu_capability()
    except (AttributeError, RuntimeError):
        return {}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX-BF16), as torch's own probe reports it;
    False where torch cannot tell."""
    capability = _cpu_capability()
    return bool(capability.get("avx512_bf16") or capability.get("amx_bf16"))


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name", else the platform's), "unknown" where neither says."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_capability(device: str | torch.device = "cpu") -> dict:
    """What computes on `device`, as profiles and sweeps record it: {"device", "name", "native_bf16", "amx"}
    (the CPU's model and instruction sets, or the GPU's name; amx None on a GPU)."""
    resolved = torch.device(device)
    if resolved.type == "cuda":
        return {"device": str(resolved), "name": torch.cuda.get_device_name(resolved),
                "native_bf16": torch.cuda.is_bf16_supported(), "amx": None}
    capability = _cpu_capability()
    return {"device": resolved.type, "name": cpu_model_name(), "native_bf16": cpu_has_native_bf16(),
            "amx": bool(capability.get("amx_bf16") or capability.get("amx_tile"))}


def choose_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None,
                 device: torch.device) -> tuple[torch.dtype, str]:
    """(compute dtype, why). `auto` picks the fastest dtype the device computes natively: on CPU bf16 where
    the CPU has native bf16 (GEMMs about 2x float32), float32 elsewhere; on a GPU the checkpoint's dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype, "given"
    if dtype not in ("auto", *_DTYPES):
        raise ConfigError(f"dtype={dtype!r} is not supported: use auto, {', '.join(_DTYPES)}")
    if dtype != "auto":
        return _DTYPES[dtype], f"--dtype {dtype}"
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16, "auto: this CPU has native bf16 (avx512_bf16 or amx_bf16)"
    if device.type == "cpu":
        return torch.float32, "auto: this CPU has no native bf16 (avx512_bf16 or amx_bf16), so bf16 would be emulated"
    checkpoint = str(checkpoint_dtype).replace("torch.", "")
    if checkpoint in _DTYPES:
        return _DTYPES[checkpoint], f"auto: the checkpoint's dtype on {device.type}"
    return torch.bfloat16, f"auto: bfloat16 on {device.type} (the checkpoint names no dtype)"


def _rope_scaling(hf: dict) -> dict | None:
    """transformers 4.x writes `rope_scaling`, 5.x writes `rope_parameters`; both end up here."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    if not params:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    return {**params, "rope_type": rope_type}


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only model, read from a Hugging Face config.json."""

    model_dir: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    dtype: torch.dtype
    checkpoint_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hf_config: dict = field(repr=False, compare=False)
    model_impl: str = "auto"  # one of MODEL_IMPLS
    # True: never capture CUDA graphs (every step eager). CUDA graphs only exist on CUDA devices;
    # on CPU every step runs eagerly whatever this says.
    enforce_eager: bool = False
    dtype_reason: str = ""  # why `dtype` was chosen (choose_dtype), logged at start
    # Each layer's sliding window ([num_layers]; None: full attention); empty: sliding_window for every layer.
    layer_sliding_windows: tuple[int | None, ...] = ()
    # MLA (DeepSeek-V2/V3): per layer, each token caches one latent of kv_lora_rank values and one rotary key
    # of qk_rope_head_dim values, shared by every head; 0: the model caches K and V per kv head.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @classmethod
    def from_hf(
        cls,
        model_dir: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        max_model_len: int | None = None,
        model_impl: str = "auto",
        enforce_eager: bool = False,
    ) -> "ModelConfig":
        if model_impl not in MODEL_IMPLS:
            raise ConfigError(f"model_impl={model_impl!r} is not a model implementation: use {', '.join(MODEL_IMPLS)}")
        device = check_device(device)
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{model_dir} has no config.json: pass a Hugging Face model directory or hub id")
        hf = _read_json_object(config_path)
        text = hf.get("text_config")
        if text and "hidden_size" not in hf:  # multimodal wrappers keep the LM's shape one level down
            hf = {**text, "architectures": hf.get("architectures")}
        hf = _with_standard_names(hf)
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ConfigError(f"{config_path} names no `architectures`: add e.g. [\"LlamaForCausalLM\"]")
        hidden_size = _positive_int(hf, "hidden_size", config_path)
        num_heads = _positive_int(hf, "num_attention_heads", config_path)
        head_dim = _positive_int(hf, "head_dim", config_path, default=hidden_size // num_heads)
        max_positions = _positive_int(hf, "max_position_embeddings", config_path, default=2048)
        sliding_window = _sliding_window(hf)
        model_len = _resolve_max_model_len(max_model_len, max_positions)
        num_layers = _positive_int(hf, "num_hidden_layers", config_path)
        checkpoint_dtype = hf.get("torch_dtype") or hf.get("dtype")
        compute_dtype, dtype_reason = choose_dtype(dtype, checkpoint_dtype, device)
        return cls(
            model_dir=str(model_dir),
            architecture=architectures[0],
            vocab_size=_positive_int(hf, "vocab_size", config_path),
            hidden_size=hidden_size,
            # Only native models read it; GPT-2-style configs leave it out (n_inner=None means 4 x hidden).
            intermediate_size=_positive_int(hf, "intermediate_size", config_path, default=4 * hidden_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=_positive_int(hf, "num_key_value_heads", config_path, default=num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=max_positions,
            max_model_len=model_len,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=sliding_window,
            dtype=compute_dtype,
            checkpoint_dtype=checkpoint_dtype,
            eos_token_ids=_eos_token_ids(model_dir, hf),
            bos_token_id=hf.get("bos_token_id"),
            hf_config=hf,
            model_impl=model_impl,
            enforce_eager=bool(enforce_eager),
            dtype_reason=dtype_reason,
            layer_sliding_windows=_layer_sliding_windows(hf, num_layers, sliding_window, config_path),
            **_latent_kv_shape(hf, config_path),
        )

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """The layer's sliding window, or None when it attends to its whole context."""
        if self.layer_sliding_windows:
            return self.layer_sliding_windows[layer_idx]
        return self.sliding_window

    @property
    def is_mla(self) -> bool:
        """The model caches MLA's latent (DeepSeek-V2/V3) rather than K and V."""
        return self.kv_lora_rank > 0

    @property
    def kv_planes(self) -> int:
        """Tensors the KV cache holds per layer: 2 (K and V), or 1 (MLA's latent)."""
        return 1 if self.is_mla else 2

    @property
    def kv_plane_shape(self) -> tuple[int, int]:
        """What one plane holds per token and layer: (kv heads, values per head); MLA's latent is one row of
        kv_lora_rank + qk_rope_head_dim values."""
        if self.is_mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The paged KV cache: [num_layers, kv_planes, num_blocks, block_size, *kv_plane_shape]."""
        return (self.num_layers, self.kv_planes, num_blocks, block_size, *self.kv_plane_shape)

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer's cache for one token: layers x planes x heads x values x dtype bytes (K/V models:
        2 x layers x kv_heads x head_dim; MLA: layers x (kv_lora_rank + qk_rope_head_dim))."""
        element = torch.empty((), dtype=self.dtype).element_size()
        heads, width = self.kv_plane_shape
        return self.num_layers * self.kv_planes * heads * width * element


def _latent_kv_shape(hf: dict, config_path: Path) -> dict[str, int]:
    """MLA's cached widths (kv_lora_rank, qk_rope_head_dim) when config.json has a kv_lora_rank, else none."""
    if hf.get("kv_lora_rank") is None:
        return {}
    return {"kv_lora_rank": _positive_int(hf, "kv_lora_rank", config_path),
            "qk_rope_head_dim": _positive_int(hf, "qk_rope_head_dim", config_path)}


def _with_standard_names(hf: dict) -> dict:
    """Some configs name the standard fields differently (GPT-2: n_embd, n_head, n_layer, n_positions).
    transformers' config classes list those aliases in `attribute_map`; fill the standard names from it."""
    if {"hidden_size", "num_attention_heads", "num_hidden_layers"} <= hf.keys():
        return hf
    from transformers import CONFIG_MAPPING

    model_type = hf.get("model_type")
    aliases = getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) if model_type in CONFIG_MAPPING else {}
    return {**{name: hf[alias] for name, alias in aliases.items() if alias in hf}, **hf}


def _positive_int(hf: dict, name: str, config_path: Path, default: int | None = None) -> int:
    """config.json's `name` as a positive integer (`default` when absent or null); ConfigError naming the field."""
    value = hf.get(name)
    if value is None and default is not None:
        return default
    if value is None:
        raise ConfigError(f"{config_path} has no `{name}`: restore the model directory's config.json (download or "
                          f"copy it again)")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{config_path}: `{name}` is {value!r}, not a positive integer: restore the model "
                          f"directory's config.json (download or copy it again)")
    return value


def _sliding_window(hf: dict) -> int | None:
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return None
    return int(window)


# Configs written before `layer_types` existed: every n-th layer is global (transformers' defaults).
_GLOBAL_LAYER_EVERY = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6, "gpt_oss": 2}


def _layer_sliding_windows(hf: dict, num_layers: int, window: int | None, config_path: Path) -> tuple[int | None, ...]:
    """Per layer: `layer_types` names each layer's kind (Gemma 2/3, gpt-oss, Qwen2); older configs give
    `sliding_window_pattern` (every pattern-th layer is global) or `max_window_layers` (Qwen: layers from
    there on slide); otherwise every layer slides (Mistral)."""
    if window is None:
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ConfigError(f"{config_path}: `layer_types` must list one type per layer ({num_layers}), got "
                              f"{layer_types!r}: restore the model directory's config.json")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    pattern = hf.get("sliding_window_pattern", _GLOBAL_LAYER_EVERY.get(hf.get("model_type")))
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    first_sliding = hf.get("max_window_layers")
    if isinstance(first_sliding, int) and not isinstance(first_sliding, bool):
        return tuple(window if i >= first_sliding else None for i in range(num_layers))
    return (window,) * num_layers


def _resolve_max_model_len(requested: int | None, max_positions: int) -> int:
    limit = max_positions
    if requested is None:
        return limit
    if requested < 1:
        raise ConfigError(f"max_model_len={requested} must be at least 1 token: leave it out for the model's own "
                          f"({limit})")
    if requested > limit:
        raise ConfigError(f"max_model_len={requested} exceeds the model's max_position_embeddings = {limit}: pass "
                          f"max_model_len <= {limit}, or leave it out for the model's own")
    return requested


def _read_json_object(path: Path) -> dict:
    """A model directory's JSON file as a dict; ConfigError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise ConfigError(f"{path} cannot be read as JSON ({exc}): restore the model directory's file (download "
                          "or copy it again)") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object: restore the model "
                          "directory's file (download or copy it again)")
    return value


def _eos_token_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    """generation_config.json wins over config.json; either may hold one id or a list."""
    eos, source = hf.get("eos_token_id"), model_dir / "config.json"
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        generation_config = _read_json_object(generation)
        if "eos_token_id" in generation_config:
            eos, source = generation_config["eos_token_id"], generation
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{source}: `eos_token_id` is {eos!r}, not a token id or a list of them: restore the "
                          f"file (download or copy it again), or set it to the id(s) of the end token")
    return tuple(ids)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: num_blocks wins; otherwise memory_bytes of cache (default: 1 GiB on CPU,
    gpu_memory_utilization of the free GPU memory after weights on CUDA)."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a positive power of two (16 is usual)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks={self.num_blocks} must be at least 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. max_num_batched_tokens is the per-step token budget; a prompt
    longer than that is prefilled in chunks of at most long_prefill_token_threshold tokens."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0 = only the step budget limits a chunk

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be at least 1")
