"""Any Hugging Face causal LM on pdserve's runtime: transformers' layers, pdserve's paged KV cache.

transformers builds the model from its config (embeddings, norms, rotary, MLP, residuals are its
own code); pdserve loads the safetensors weights itself and runs one step's T tokens (decodes, then
prefill chunks of several requests) as a single batch-1 sequence. Every attention layer calls
`pdserve_attention`, registered with transformers' AttentionInterface, which hands q/k/v to an
engine.layers.attention.Attention bound to pdserve's KV cache: storing KV and the paged
decode/prefill attention are the native models' own. Which tokens belong to which request comes
from the forward context, so transformers builds no mask ("pdserve" is not a mask implementation,
and create_causal_mask returns None for such names) and keeps no past_key_values (use_cache=False).

Each layer's sliding window, logit soft cap and sinks (Gemma 2/3, gpt-oss) are read from its module and
bound to its pdserve Attention. What pdserve's attention cannot express (ALiBi, cross or bidirectional
attention, different K and V head sizes, non-attention mixer layers) is refused at load time with
UnsupportedModelFeatureError naming the feature.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.attention import Attention
from pdserve.engine.layers.linear import copy_checked, pack_torch_linears
from pdserve.engine.loader import ModelLoadError

ATTN_IMPLEMENTATION = "pdserve"
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelFeatureError(ValueError):
    """The model needs an attention feature pdserve's paged attention does not implement."""


# ---------------------------------------------------------------------------------------------
# The attention function transformers calls in every attention layer
# ---------------------------------------------------------------------------------------------


def pdserve_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, T, head_dim], rotary applied
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,  # None: create_causal_mask skips unknown implementations
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, T, num_heads, head_dim], no attention weights)
    attn: Attention | None = getattr(module, "pdserve_attention", None)
    if attn is None:
        raise RuntimeError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) called pdserve's attention but is "
            "not bound to pdserve's KV cache: build the model through TransformersForCausalLM"
        )
    _check_call(attn, query, key, scaling, kwargs)
    num_tokens = query.shape[2]
    out = attn(_tokens_first(query), _tokens_first(key), _tokens_first(value))  # [T, num_heads * head_dim]
    return out.view(1, num_tokens, attn.num_heads, attn.head_dim), None


def _tokens_first(states: torch.Tensor) -> torch.Tensor:
    # [1, heads, T, head_dim] -> [T, heads, head_dim], contiguous as the kernels read it
    return states[0].transpose(0, 1).contiguous()


def _check_call(attn: Attention, query: torch.Tensor, key: torch.Tensor, scaling: float | None, kwargs: dict) -> None:
    """Cheap per-call guards: shapes the KV cache was sized for, the scale, and features we cannot honour."""
    if query.shape[0] != 1:
        raise RuntimeError(f"pdserve's attention runs one flattened sequence (batch 1), got batch {query.shape[0]}")
    if key.shape[1] != attn.num_kv_heads or key.shape[3] != attn.head_dim or query.shape[1] != attn.num_heads:
        raise RuntimeError(
            f"layer {attn.layer_idx} produced q {tuple(query.shape)} / k {tuple(key.shape)}, but the KV cache was "
            f"sized for {attn.num_heads} heads, {attn.num_kv_heads} kv heads of {attn.head_dim}: config.json's "
            "num_attention_heads / num_key_value_heads / head_dim do not describe this model"
        )
    if scaling is not None and scaling != attn.scale:
        raise RuntimeError(
            f"layer {attn.layer_idx} asked for attention scale {scaling} but was bound with {attn.scale} (the "
            "module's `scaling` at build time): models whose scale changes after construction are not supported"
        )
    changed = [name for name in ("s_aux", "sinks") if kwargs.get(name) is not None and kwargs[name] is not attn.sinks]
    if kwargs.get("softcap") not in (None, attn.soft_cap):
        changed.append("softcap")
    if changed:
        raise UnsupportedModelFeatureError(
            f"layer {attn.layer_idx} asked for attention `{changed[0]}` other than the one bound at build time: "
            "models whose attention options change after construction are not supported")
    if kwargs.get("sliding_window", attn.sliding_window) != attn.sliding_window:
        raise UnsupportedModelFeatureError(
            f"layer {attn.layer_idx} asked for sliding window {kwargs['sliding_window']} but was bound with "
            f"{attn.sliding_window}: models whose windows change after construction are not supported")


AttentionInterface.register(ATTN_IMPLEMENTATION, pdserve_attention)


# ---------------------------------------------------------------------------------------------
# Load-time checks: features pdserve's attention cannot express
# ---------------------------------------------------------------------------------------------


def unsupported_features(hf_config: PretrainedConfig) -> list[str]:
    """Human-readable names of the features this config needs that pdserve lacks (empty: fine)."""
    found = []
    if getattr(hf_config, "alibi", False) or getattr(hf_config, "position_embedding_type", None) == "alibi":
        found.append("ALiBi position biases")
    if getattr(hf_config, "is_encoder_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        found.append("cross-attention (encoder-decoder)")
    if getattr(hf_config, "is_causal", True) is False or getattr(hf_config, "use_bidirectional_attention", False):
        found.append("bidirectional (non-causal) attention")
    v_head_dim = getattr(hf_config, "v_head_dim", None)
    if getattr(hf_config, "kv_lora_rank", None) or (v_head_dim and v_head_dim != getattr(hf_config, "head_dim", None)):
        found.append("latent / different-sized K and V heads (kv_lora_rank, v_head_dim)")
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    others = sorted({t for t in layer_types if t not in _ATTENTION_LAYER_TYPES})
    if others:
        found.append(f"non-attention layers ({', '.join(others)})")
    return found


def _module_features(module: nn.Module) -> list[str]:
    found = []
    if getattr(module, "is_causal", True) is False:
        found.append("bidirectional (non-causal) attention")
    return found


def _raise_if_unsupported(architecture: str, features: list[str]) -> None:
    if features:
        raise UnsupportedModelFeatureError(
            f"{architecture} needs {'; '.join(sorted(set(features)))}, which pdserve's paged attention does not "
            "implement: this model cannot run on pdserve yet"
        )


# ---------------------------------------------------------------------------------------------
# Building the transformers model and binding its attention layers
# ---------------------------------------------------------------------------------------------


def load_hf_config(model_dir: str) -> PretrainedConfig:
    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    hf_config.use_cache = False  # pdserve owns the KV cache; transformers must not keep past_key_values
    return hf_config


def build_hf_model(hf_config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The transformers causal LM, parameters allocated but not initialised (the loader fills them)."""
    with no_init_weights():
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    hf_model.tie_weights()  # no_init_weights also skips the tying that init_weights does
    return hf_model.eval().requires_grad_(False)


def attention_modules(hf_model: nn.Module, num_layers: int) -> list[nn.Module]:
    """The attention module of each layer, by `layer_idx` ([num_layers]); an error unless exactly one each."""
    by_layer: dict[int, list[nn.Module]] = {}
    for module in hf_model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and hasattr(module, "is_causal"):
            by_layer.setdefault(layer_idx, []).append(module)
    counts = [len(by_layer.get(i, ())) for i in range(num_layers)]
    if counts != [1] * num_layers or len(by_layer) != num_layers:
        raise UnsupportedModelFeatureError(
            f"expected one attention module per layer for {num_layers} layers, found per layer {counts} "
            f"(layer ids {sorted(by_layer)}): this architecture's layers are not plain self-attention"
        )
    return [by_layer[i][0] for i in range(num_layers)]


def _module_head_dim(module: nn.Module, config: ModelConfig) -> int:
    return int(getattr(module, "head_dim", None) or getattr(module, "head_size", None) or config.head_dim)


def bind_attention(module: nn.Module, layer_idx: int, config: ModelConfig) -> Attention:
    """A pdserve Attention for one transformers attention module, with the module's own scale."""
    head_dim = _module_head_dim(module, config)
    if head_dim != config.head_dim:
        raise UnsupportedModelFeatureError(
            f"layer {layer_idx} has head_dim {head_dim} but config.json gives {config.head_dim}: pdserve sizes the KV "
            "cache from config.json's head_dim (or hidden_size / num_attention_heads); set head_dim there"
        )
    scaling = getattr(module, "scaling", None)
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    window = getattr(module, "sliding_window", config.sliding_window_of(layer_idx))  # Gemma 2/3, gpt-oss: per layer
    soft_cap = getattr(module, "attn_logit_softcapping", None)  # Gemma 2
    attn = Attention(layer_idx, config.num_heads, config.num_kv_heads, head_dim, scale, sliding_window=window,
                     soft_cap=float(soft_cap) if soft_cap else None, sinks=getattr(module, "sinks", None))
    module.pdserve_attention = attn  # registered as a child: no parameters, moves with the model
    return attn


# ---------------------------------------------------------------------------------------------
# Logits: what transformers' *ForCausalLM.forward does after the lm_head
# ---------------------------------------------------------------------------------------------


def logit_transform(hf_config: PretrainedConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Granite divides by logits_scaling, Cohere multiplies by logit_scale, Gemma 2/3 soft-cap."""
    scale = 1.0
    if getattr(hf_config, "logits_scaling", None):
        scale /= float(hf_config.logits_scaling)
    if getattr(hf_config, "logit_scale", None):
        scale *= float(hf_config.logit_scale)
    cap = getattr(hf_config, "final_logit_softcapping", None)
    if scale == 1.0 and not cap:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:  # [R, vocab] float32
        logits = logits * scale if scale != 1.0 else logits
        return torch.tanh(logits / cap) * cap if cap else logits

    return transform


# ---------------------------------------------------------------------------------------------
# The model class the registry hands out
# ---------------------------------------------------------------------------------------------


class TransformersForCausalLM(nn.Module):
    """Same interface as the native models: forward, compute_logits, bind_kv_cache, config."""

    packed_modules_mapping: ClassVar[dict] = {}  # checkpoint names are transformers' own parameter names

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hf_config = load_hf_config(config.model_dir)
        features = unsupported_features(hf_config)
        _raise_if_unsupported(config.architecture, features)
        self.hf_model = build_hf_model(hf_config, config.dtype)
        if not self.hf_model.is_backend_compatible():
            raise UnsupportedModelFeatureError(
                f"{config.architecture}: transformers' code for it computes attention itself instead of calling an "
                "AttentionInterface function (_supports_attention_backend is False), so its attention cannot use "
                "pdserve's KV cache: this model cannot run on pdserve yet"
            )
        modules = attention_modules(self.hf_model, config.num_layers)
        _raise_if_unsupported(config.architecture, [f for m in modules for f in _module_features(m)])
        self.attention_layers = [bind_attention(m, i, config) for i, m in enumerate(modules)]
        self.lm_head = _output_embeddings(self.hf_model)
        self.logit_transform = logit_transform(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (the base model's final norm applied)."""
        out = self.hf_model.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab] (float32)."""
        logits = self.lm_head(hidden).float()
        return self.logit_transform(logits) if self.logit_transform is not None else logits

    def bind_kv_cache(self, kv_cache: torch.Tensor, attn_backend: AttentionBackend) -> None:
        """kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
        for layer_idx, attn in enumerate(self.attention_layers):
            attn.bind_kv_cache(kv_cache[layer_idx, 0], kv_cache[layer_idx, 1], attn_backend)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors under transformers' names; each parameter exactly once (tied ones once)."""
        load_hf_weights(self.hf_model, weights)
        pack_torch_linears(self.hf_model)  # CPU: oneDNN layout, like the native models' linears


def _output_embeddings(hf_model: nn.Module) -> nn.Module:
    lm_head = hf_model.get_output_embeddings()
    if lm_head is None:
        raise UnsupportedModelFeatureError(
            f"{type(hf_model).__name__} has no output embedding (lm_head): not a causal LM pdserve can sample from"
        )
    return lm_head


# ---------------------------------------------------------------------------------------------
# Weights: checkpoint names are transformers' parameter names (after transformers' own renames)
# ---------------------------------------------------------------------------------------------


class CheckpointConversion:
    """transformers 5's own load-time conversion of checkpoint names and tensors: renames (legacy
    names, e.g. GPT-NeoX's embed_out -> lm_head, and base-model prefixes) and converters that fuse or
    split tensors (e.g. per-expert MoE weights stacked into one [experts, ...] parameter)."""

    def __init__(self, hf_model: nn.Module, param_names: set[str]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(hf_model)
        self.hf_model = hf_model
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.converter_by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        self.known = dict.fromkeys(param_names, True)  # rename_source_key looks names up with .get()
        self.prefix = getattr(hf_model, "base_model_prefix", None)
        # converted parameter -> its checkpoint tensors: (checkpoint name, source pattern, tensor)
        self.pending: dict[str, list[tuple[str, str, torch.Tensor]]] = {}

    def rename(self, name: str) -> tuple[str, str | None]:
        """Checkpoint name -> (parameter name, the converter's source pattern or None)."""
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(name, self.renamings, self.converters, self.prefix, self.known)
        if renamed not in self.known and name in self.known:
            return name, None
        return renamed, pattern

    def collect(self, target: str, checkpoint_name: str, pattern: str, tensor: torch.Tensor) -> None:
        self.pending.setdefault(target, []).append((checkpoint_name, pattern, tensor))

    def converted(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(parameter name, the checkpoint names it came from, tensor) for every collected parameter."""
        from copy import deepcopy

        from transformers.core_model_loading import dot_natural_key

        for target, sources in self.pending.items():
            converter = deepcopy(self.converter_by_pattern[sources[0][1]])
            sources.sort(key=lambda source: dot_natural_key(source[0]))  # experts 0, 1, ..., 10 in order
            for checkpoint_name, pattern, tensor in sources:
                converter.add_tensor(target, checkpoint_name, pattern, tensor)
            origin = f"{sources[0][0]} (+{len(sources) - 1} more)"
            try:
                outputs = converter.convert(target, model=self.hf_model, config=self.hf_model.config)
            except Exception as exc:  # noqa: BLE001 - transformers' ops raise many kinds for bad inputs
                raise ModelLoadError(f"transformers could not convert checkpoint tensors {origin} into {target}: "
                                     f"{exc}; the checkpoint does not match config.json") from exc
            for name, tensor in outputs.items():
                yield name, origin, tensor
        self.pending.clear()


def load_hf_weights(hf_model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(hf_model.named_parameters(remove_duplicate=False))  # tied weights under every name
    canonical = {id(p): name for name, p in hf_model.named_parameters()}  # one name per tensor
    buffers = dict(hf_model.named_buffers())
    persistent = {name: buffers[name] for name in hf_model.state_dict() if name in buffers}
    conversion = CheckpointConversion(hf_model, set(params) | set(buffers))
    # Recomputed at build time (rotary tables, old per-layer copies too) or listed by the model as ignorable.
    ignored = [re.compile(p) for p in getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    ignored.append(re.compile(r"rotary_emb\.inv_freq$"))
    seen: set[str] = set()
    loaded: set[str] = set()  # canonical names
    for checkpoint_name, tensor in weights:
        if checkpoint_name in seen:
            raise ModelLoadError(
                f"checkpoint holds tensor {checkpoint_name} twice; the model directory is inconsistent"
            )
        seen.add(checkpoint_name)
        name, pattern = conversion.rename(checkpoint_name)
        if pattern is not None:  # converted with the other tensors of its parameter, below
            conversion.collect(name, checkpoint_name, pattern, tensor)
        elif name in params:
            copy_checked(params[name].data, tensor, checkpoint_name)
            loaded.add(canonical[id(params[name])])
        elif name in persistent:  # buffers a model saves with its weights
            copy_checked(persistent[name], tensor, checkpoint_name)
        elif name not in buffers and not any(p.search(checkpoint_name) for p in ignored):
            raise ModelLoadError(
                f"checkpoint has unexpected tensor {checkpoint_name}: it does not belong to {type(hf_model).__name__}"
            )
    for name, origin, tensor in conversion.converted():
        if name not in params:
            raise ModelLoadError(f"checkpoint tensors {origin} convert to {name}, which {type(hf_model).__name__} "
                                 "does not have")
        copy_checked(params[name].data, tensor, origin)
        loaded.add(canonical[id(params[name])])
    missing = sorted(set(canonical.values()) - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")
