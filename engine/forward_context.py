"""Per-step attention metadata, installed around one forward pass.

Models only call `self.attn(q, k, v)`; the attention layer finds slot mappings and block tables here,
and what its attention backend prepared from them for the whole step.
Tokens of a step are ordered decodes first (one token per sequence), then prefill chunks. A model whose
layers keep KV in several block tables (engine/kv_cache_groups.py) has one context per layer group, each
with that group's slot mapping and block tables; a layer reads its group's metadata.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from pdserve.engine.attention.backend import AttentionBackend


@dataclass
class ForwardContext:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each token's new K/V
    num_decode_tokens: int  # the first num_decode_tokens tokens each belong to their own sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context length including the new token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets into the prefill tokens
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context length including the chunk
    # Called with the layer index right after that layer's K/V is in the cache (KV streaming).
    on_layer_stored: Callable[[int], None] | None = None
    # The attention backend's prepare() of the fields above, shared by every layer. Rebuilt whenever
    # the context is installed, so a CUDA graph capture records the ops that build it.
    attn_metadata: Any = None
    # Several layer groups: each group's context (group_contexts[0] is this one's tables) and each layer's
    # group; attn_metadata then holds one prepare() per group. Empty: one block table for every layer.
    group_contexts: tuple[ForwardContext, ...] = ()
    group_of_layer: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def layer_metadata(self, layer_idx: int) -> Any:
        """The attention backend's metadata for this layer's block table."""
        if not self.group_contexts:
            return self.attn_metadata
        return self.attn_metadata[self.group_of_layer[layer_idx]]


_current: ForwardContext | None = None


@contextlib.contextmanager
def use_forward_context(context: ForwardContext, attn_backend: AttentionBackend) -> Iterator[ForwardContext]:
    """Install `context` for one forward pass, with attn_backend's metadata for the step."""
    global _current
    if _current is not None:
        raise RuntimeError("a forward context is already installed: forward passes cannot nest")
    if context.group_contexts:
        context.attn_metadata = tuple(attn_backend.prepare(group) for group in context.group_contexts)
    else:
        context.attn_metadata = attn_backend.prepare(context)
    _current = context
    try:
        yield context
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward pass: wrap the call in use_forward_context()")
    return _current
