"""Attention over pdserve's paged KV cache: the only module that reads or writes KV."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.forward_context import ForwardContext, get_forward_context
from pdserve.kernels import torch_paged


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
        # The torch kernels split into a per-step plan (shared by all layers) and a per-layer run.
        self.planned = False

    def bind_kv_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        self.key_cache, self.value_cache = key_cache, value_cache
        self.planned = kernels.kernel_backend(key_cache.device) == "torch"

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim], rotary applied
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        if self.key_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache bound: the engine allocates it")
        ctx = get_forward_context()
        self._store(key, value, ctx)
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

    def _store(self, key: torch.Tensor, value: torch.Tensor, ctx: ForwardContext) -> None:
        if self.planned:
            plan = ctx.cached("store_plan", lambda: torch_paged.plan_store(ctx.slot_mapping))
            torch_paged.store_kv_planned(key, value, self.key_cache, self.value_cache, plan)
        else:
            kernels.store_kv(key, value, self.key_cache, self.value_cache, ctx.slot_mapping)

    def _decode(self, query: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.planned:
            block_size = self.key_cache.shape[1]
            plan = ctx.cached("decode_plan", lambda: torch_paged.plan_decode(
                ctx.decode_block_tables, ctx.decode_seq_lens, block_size))
            return torch_paged.decode_attention_planned(query, self.key_cache, self.value_cache, plan, self.scale)
        return kernels.paged_decode_attention(
            query, self.key_cache, self.value_cache, ctx.decode_block_tables, ctx.decode_seq_lens, self.scale
        )

    def _prefill(self, query: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.planned:
            block_size = self.key_cache.shape[1]
            plan = ctx.cached("prefill_plan", lambda: torch_paged.plan_prefill(
                ctx.prefill_block_tables, ctx.prefill_query_start_loc, ctx.prefill_seq_lens, block_size))
            return torch_paged.prefill_attention_planned(query, self.key_cache, self.value_cache, plan, self.scale)
        return kernels.paged_prefill_attention(
            query, self.key_cache, self.value_cache, ctx.prefill_block_tables,
            ctx.prefill_query_start_loc, ctx.prefill_seq_lens, self.scale,
        )
