"""Pure-torch implementations of every kernel: the reference the Triton kernels are tested against,
and the implementation used on CPU.

Shapes (T = tokens in the step, S = sequences, N = blocks in the pool, B = block size):
  key_cache / value_cache  [N, B, num_kv_heads, head_dim]   (one layer)
  kv_cache                 [num_layers, 2, N, B, num_kv_heads, head_dim]   (all layers, K then V);
                           kv_pack / kv_unpack take any [num_layers, planes, N, B, *per_token]
                           (an MLA latent cache has 1 plane)
  block_tables             [S, max_blocks] int32, slot s of a sequence lives in
                           block block_tables[seq, s // B] at offset s % B
Attention options: sliding_window W (the query at position p sees keys (p - W, p]), soft_cap
(logits become cap * tanh(logit / cap)), sinks ([num_heads] logits that join each head's softmax
denominator with no value).
"""

from __future__ import annotations

import torch

from pdserve.kernels import torch_paged


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; slot = block_id * B + offset; negative = skip
) -> None:
    """Write each token's key/value into its cache slot; tokens with a negative slot are skipped."""
    torch_paged.store_kv_planned(key, value, key_cache, value_cache, torch_paged.plan_store(slot_mapping))


def paged_decode_attention(
    query: torch.Tensor,  # [S, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including the new token
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [S, num_heads, head_dim]
    """Attention of one query token per sequence over that sequence's cached context (or its window)."""
    plan = torch_paged.plan_decode(block_tables, seq_lens, key_cache.shape[1], sliding_window=sliding_window)
    return torch_paged.decode_attention_planned(query, key_cache, value_cache, plan, scale, soft_cap, sinks)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of all sequences, concatenated
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim], new tokens already stored
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32, sequence i owns query rows [loc[i], loc[i+1])
    seq_lens: torch.Tensor,  # [S] int32, context length including this step's new tokens
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves.

    Query row j of a sequence with q new tokens and context length L sits at position p = L - q + j and
    attends to positions [0, p], or (p - sliding_window, p] with a window.
    """
    plan = torch_paged.plan_prefill(block_tables, query_start_loc, seq_lens, key_cache.shape[1], sliding_window)
    return torch_paged.prefill_attention_planned(query, key_cache, value_cache, plan, scale, soft_cap, sinks)


def kv_pack(
    kv_cache: torch.Tensor,  # [num_layers, planes, N, B, *per_token]: planes 2 (K, V) or 1 (a latent)
    block_ids: torch.Tensor,  # [num_blocks] int32/int64, the request's blocks holding the tokens, in order
    num_tokens: int,  # tokens to take, starting at offset 0 of block_ids[0]
    layer_start: int = 0,
    layer_end: int | None = None,
) -> torch.Tensor:  # [layer_end - layer_start, planes, num_tokens, *per_token], contiguous
    """Gather num_tokens tokens of KV from the given blocks, for a range of layers, into one buffer."""
    layers = kv_cache[layer_start:layer_end]
    block_size = kv_cache.shape[3]
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = layers.index_select(2, block_ids[:num_blocks].long())  # [nl, planes, nb, B, *per_token]
    return blocks.flatten(2, 3)[:, :, :num_tokens].contiguous()


def kv_unpack(
    buffer: torch.Tensor,  # [num_layers_in_buffer, planes, num_tokens, *per_token]
    kv_cache: torch.Tensor,  # [num_layers, planes, N, B, *per_token]
    block_ids: torch.Tensor,  # [num_blocks] int32/int64, destination blocks, in order
    num_tokens: int,
    layer_start: int = 0,
) -> None:
    """Scatter a packed buffer into the destination blocks (inverse of kv_pack)."""
    num_layers_in = buffer.shape[0]
    block_size = kv_cache.shape[3]
    positions = torch.arange(num_tokens, device=kv_cache.device)
    slots = block_ids.long()[positions // block_size] * block_size + positions % block_size
    layers = kv_cache[layer_start:layer_start + num_layers_in]
    flat = layers.flatten(2, 3)  # a view: [nl, planes, N * B, *per_token]
    flat.index_copy_(2, slots, buffer.to(kv_cache.dtype))
