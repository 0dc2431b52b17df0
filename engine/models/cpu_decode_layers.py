"""Decode steps of a Llama-family model through all its decoder layers in one native call on the CPU
(kernels/cpu_decode_layers.c), where the model and the step allow it; every other step runs the layers one by one.

Which models: a DecoderStack whose every layer is the plain Llama layer (DecoderAttention, q/k norms or not; GatedMLP)
with bf16 weights packed for pdserve's bf16 product, the CPU backend's native norms and rotary bound, and attention
with no sliding window, soft cap or sinks. Which steps: decode-only (one token per sequence), one block table for
every layer, no per-layer KV streaming. The native call runs the same kernels in the same order, so its output
equals the layer-by-layer path's bit for bit (tests/engine/test_cpu_decode_layers.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.rotary import Rotation, TableRotation
from pdserve.engine.models.llama import DecoderAttention, DecoderLayer, DecoderStack, GatedMLP
from pdserve.kernels import cpu_decode_layers, cpu_norm_rotary
from pdserve.kernels.cpu_native import int32_contiguous

logger = logging.getLogger(__name__)


def bind(model: nn.Module) -> None:
    """Give each eligible DecoderStack in `model` its one-call decode step (logged either way)."""
    for stack in (module for module in model.modules() if isinstance(module, DecoderStack)):
        reason = ineligible_reason(stack)
        if reason is None:
            stack.native_decode = NativeDecodeStep(stack)
        logger.info("CPU decode steps: %s", "every decoder layer in one native call" if reason is None else
                    f"layer by layer ({reason})")


def ineligible_reason(stack: DecoderStack) -> str | None:
    """Why this stack's decode steps cannot run in one native call, or None when they can."""
    layers = list(stack.layers)
    if not layers or not all(type(layer) is DecoderLayer and type(layer.self_attn) is DecoderAttention
                             and type(layer.mlp) is GatedMLP for layer in layers):
        return "a layer other than the plain Llama attention and gated MLP"
    attentions = [layer.self_attn for layer in layers]
    if any(attn.attn.sliding_window or attn.attn.soft_cap or attn.attn.sinks is not None for attn in attentions):
        return "a sliding window, soft cap or sinks"
    linears = [linear for layer in layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if any(linear.native_weight is None or linear.native_weight.dtype != torch.bfloat16 for linear in linears):
        return "linears not on the bf16 kernel"
    norms = [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                                                   layer.self_attn.q_norm, layer.self_attn.k_norm) if norm is not None]
    if any(norm.kernel is not cpu_norm_rotary.add_rms_norm or norm.weight.dtype != torch.bfloat16 for norm in norms):
        return "norms not on the native kernel"
    if len({norm.eps for norm in norms}) != 1 or len({attn.attn.scale for attn in attentions}) != 1:
        return "layers with different norm epsilons or attention scales"
    if not cpu_decode_layers.available():  # last: the first call builds its library
        return "the native kernels are not built here"
    return None


class NativeDecodeStep:
    """Called by DecoderStack.forward each step: (last output, residual) for a step it takes, else None."""

    def __init__(self, stack: DecoderStack) -> None:
        self.stack = stack
        self.layers: cpu_decode_layers.DecodeLayers | None = None  # built at the first step: the KV cache is bound

    def __call__(self, hidden: torch.Tensor, rotation: Rotation) -> tuple[torch.Tensor, torch.Tensor] | None:
        context = get_forward_context()
        if (context.num_decode_tokens != hidden.shape[0] or context.group_contexts or context.on_layer_stored
                or context.slot_mapping.dtype != torch.int64 or hidden.dtype != torch.bfloat16
                or not isinstance(rotation, TableRotation) or rotation.native_rotate is None
                or not hasattr(context.attn_metadata, "native_decode_args")):
            return None
        layers = self._layers()
        if layers is None:
            return None
        cos, half = rotation.cos, rotation.cos.shape[-1]  # [T, 1, D/2] of a [T, 1, D] cos | sin table
        if cos.stride() != (2 * half, 2 * half, 1) or rotation.sin.data_ptr() != cos.data_ptr() + 2 * half:
            return None
        block_tables, seq_lens = context.attn_metadata.native_decode_args
        cos_sin = cos.as_strided((hidden.shape[0], 2 * half), (2 * half, 1))  # [T, D]
        return layers.run(hidden.contiguous(), cos_sin, context.slot_mapping.contiguous(),
                          int32_contiguous(block_tables), int32_contiguous(seq_lens))

    def _layers(self) -> cpu_decode_layers.DecodeLayers | None:
        first = self.stack.layers[0].self_attn.attn
        if first.key_cache is None or first.key_cache.dtype != torch.bfloat16:
            return None
        if self.layers is None or self.layers.layers[0].key_cache.data_ptr() != first.key_cache.data_ptr():
            self.layers = _decode_layers(self.stack)
        return self.layers


def _decode_layers(stack: DecoderStack) -> cpu_decode_layers.DecodeLayers:
    weights = []
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights.append(cpu_decode_layers.LayerWeights(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            attn.qkv_proj.native_weight, attn.qkv_proj.bias, attn.o_proj.native_weight, attn.o_proj.bias,
            mlp.gate_up_proj.native_weight, mlp.gate_up_proj.bias, mlp.down_proj.native_weight, mlp.down_proj.bias,
            attn.attn.key_cache, attn.attn.value_cache,
            None if attn.q_norm is None else attn.q_norm.weight, None if attn.k_norm is None else attn.k_norm.weight))
    first = stack.layers[0]
    attn = first.self_attn
    shape = cpu_decode_layers.StackShape(first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads,
                                         attn.head_dim, first.mlp.down_proj.in_features, first.input_layernorm.eps,
                                         attn.attn.scale)
    return cpu_decode_layers.DecodeLayers(shape, weights)
