"""The Triton attention backend (CUDA, or PDSERVE_KERNELS=triton): paged KV store, decode and prefill
kernels over the step's tensors, and the fused add+RMSNorm and rotary kernels for the model's layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.forward_context import ForwardContext
from pdserve.engine.layers.attention import Attention
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.kernels.triton_decode_attention import paged_decode_attention
from pdserve.kernels.triton_norm import add_rms_norm
from pdserve.kernels.triton_prefill_attention import paged_prefill_attention
from pdserve.kernels.triton_rotary import rotary_embedding
from pdserve.kernels.triton_store_kv import store_kv


@dataclass(frozen=True)
class TritonMetadata:
    """The step's tensors the kernels read on the device (no host reads: a CUDA graph can capture them)."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32


class TritonBackend(AttentionBackend[TritonMetadata]):
    name = "triton"
    supports_cuda_graphs = True

    def prepare(self, context: ForwardContext) -> TritonMetadata:
        return TritonMetadata(context.slot_mapping, context.decode_block_tables, context.decode_seq_lens,
                              context.prefill_block_tables, context.prefill_query_start_loc, context.prefill_seq_lens)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, layer: Attention, metadata: TritonMetadata) -> None:
        store_kv(key, value, layer.key_cache, layer.value_cache, metadata.slot_mapping)

    def forward_decode(self, query: torch.Tensor, layer: Attention, metadata: TritonMetadata) -> torch.Tensor:
        return paged_decode_attention(query, layer.key_cache, layer.value_cache, metadata.decode_block_tables,
                                      metadata.decode_seq_lens, layer.scale, layer.sliding_window, layer.soft_cap,
                                      layer.sinks)

    def forward_prefill(self, query: torch.Tensor, layer: Attention, metadata: TritonMetadata) -> torch.Tensor:
        return paged_prefill_attention(query, layer.key_cache, layer.value_cache, metadata.prefill_block_tables,
                                       metadata.prefill_query_start_loc, metadata.prefill_seq_lens, layer.scale,
                                       layer.sliding_window, layer.soft_cap, layer.sinks)

    def bind_layer_kernels(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.use_kernel(add_rms_norm_rows)
            elif isinstance(module, RotaryEmbedding):
                module.use_kernel(rotary_embedding)


def add_rms_norm_rows(
    hidden: torch.Tensor,  # [T, hidden_size], or [T, num_heads, head_dim] (q/k norms): rows are the last dim
    residual: torch.Tensor | None,  # same shape as hidden, or None
    weight: torch.Tensor,  # [hidden.shape[-1]]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, hidden + residual), hidden's shape
    """The 2-D Triton add_rms_norm over the last dimension of any rank."""
    rows = hidden.reshape(-1, hidden.shape[-1])  # a view for 2-D input; q/k heads are copied into rows
    normed, summed = add_rms_norm(rows, None if residual is None else residual.reshape(rows.shape), weight, eps)
    return normed.view(hidden.shape), summed.view(hidden.shape)
