"""Attention over pdserve's paged KV cache: the only module that reads or writes KV, through the
attention backend the model runner bound to it. A layer may have a sliding window (the query at
position p sees keys (p - window, p]), a logit soft cap (cap * tanh(logit / cap)) and sinks (one
logit per head that joins the softmax denominator with no value)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pdserve.engine.attention.backend import AttentionBackend


class Attention(nn.Module):
    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        sliding_window: int | None = None, soft_cap: float | None = None, sinks: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.sinks = sinks  # [num_heads], loaded with the model's weights
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.value_cache: torch.Tensor | None = None
        self.attn_backend: AttentionBackend | None = None

    def bind_kv_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor, attn_backend: AttentionBackend) -> None:
        self.key_cache, self.value_cache, self.attn_backend = key_cache, value_cache, attn_backend

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim], rotary applied
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        if self.attn_backend is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache bound: the engine allocates it")
        return self.attn_backend.forward(query, key, value, self)


def shared_sliding_window(model: nn.Module) -> int | None:
    """The sliding window of every attention layer of the model when they all have the same one, else None
    (some layer, or every one, sees its whole context): what the KV cache manager may free blocks by."""
    windows = {module.sliding_window for module in model.modules() if isinstance(module, Attention)}
    return windows.pop() if len(windows) == 1 else None
