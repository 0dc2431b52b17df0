"""Attention over pdserve's paged KV cache: the only module that reads or writes KV."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.value_cache: torch.Tensor | None = None

    def bind_kv_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        self.key_cache, self.value_cache = key_cache, value_cache

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim], rotary applied
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        if self.key_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache bound: the engine allocates it")
        ctx = get_forward_context()
        kernels.store_kv(key, value, self.key_cache, self.value_cache, ctx.slot_mapping)
        if ctx.on_layer_stored is not None:
            ctx.on_layer_stored(self.layer_idx)
        num_decode = ctx.num_decode_tokens
        if num_decode == query.shape[0]:
            out = self._decode(query, ctx)
        elif num_decode == 0:
            out = self._prefill(query, ctx)
        else:
            out = torch.cat((self._decode(query[:num_decode], ctx), self._prefill(query[num_decode:], ctx)))
        return out.flatten(1)

    def _decode(self, query: torch.Tensor, ctx) -> torch.Tensor:
        return kernels.paged_decode_attention(
            query, self.key_cache, self.value_cache, ctx.decode_block_tables, ctx.decode_seq_lens, self.scale
        )

    def _prefill(self, query: torch.Tensor, ctx) -> torch.Tensor:
        return kernels.paged_prefill_attention(
            query, self.key_cache, self.value_cache, ctx.prefill_block_tables,
            ctx.prefill_query_start_loc, ctx.prefill_seq_lens, self.scale,
        )
