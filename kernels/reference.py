"""Pure-torch implementations of every kernel: the reference the Triton kernels are tested against,
and the implementation used on CPU.

Shapes (T = tokens in the step, S = sequences, N = blocks in the pool, B = block size):
  key_cache / value_cache  [N, B, num_kv_heads, head_dim]   (one layer)
  kv_cache                 [num_layers, 2, N, B, num_kv_heads, head_dim]   (all layers, K then V)
  block_tables             [S, max_blocks] int32, slot s of a sequence lives in
                           block block_tables[seq, s // B] at offset s % B
"""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; slot = block_id * B + offset; negative = skip
) -> None:
    """Write each token's key/value into its cache slot; tokens with a negative slot are skipped."""
    num_blocks, block_size = key_cache.shape[:2]
    flat_k = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_v = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping.long(), key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping.long(), value.to(flat_v.dtype))


def _gather_context(
    cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks_used] (one sequence)
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    num_blocks_used = (context_len + cache.shape[1] - 1) // cache.shape[1]
    blocks = cache.index_select(0, block_table[:num_blocks_used].long())
    return blocks.flatten(0, 1)[:context_len]


def paged_decode_attention(
    query: torch.Tensor,  # [S, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including the new token
    scale: float,
) -> torch.Tensor:  # [S, num_heads, head_dim]
    """Attention of one query token per sequence over that sequence's whole cached context."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(seq_lens.max())
    if max_len == 0:
        return torch.zeros_like(query)
    num_blocks = (max_len + block_size - 1) // block_size
    # Gather whole blocks of every sequence at once (index_select is the fast gather on CPU) and view
    # them as [S, num_kv_heads, max_len, head_dim]; SDPA runs fused attention over that (GQA native).
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()
    keys = _gather_padded(key_cache, block_ids, num_seqs, max_len)
    values = _gather_padded(value_cache, block_ids, num_seqs, max_len)
    mask = None
    if bool((seq_lens != max_len).any()):  # shorter sequences must not see the padded tail
        mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]  # [S, max_len]
        mask = mask[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float().view(num_seqs, num_heads, 1, head_dim), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [S, num_heads, 1, head_dim]
    if mask is not None and bool((seq_lens == 0).any()):  # an empty (padding) sequence: zeros, not NaN
        out = torch.nan_to_num(out, nan=0.0)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def _gather_padded(
    cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [S * num_blocks] int64
    num_seqs: int,
    max_len: int,
) -> torch.Tensor:  # [S, num_kv_heads, max_len, head_dim] float32 (a view when the cache is float32)
    blocks = cache.index_select(0, block_ids)  # [S * num_blocks, B, num_kv_heads, head_dim]
    per_seq = blocks.view(num_seqs, -1, *cache.shape[2:])[:, :max_len]
    return per_seq.transpose(1, 2).float()


def paged_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of all sequences, concatenated
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim], new tokens already stored
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32, sequence i owns query rows [loc[i], loc[i+1])
    seq_lens: torch.Tensor,  # [S] int32, context length including this step's new tokens
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves.

    Query row j of a sequence with q new tokens and context length L sits at position L - q + j and
    attends to positions [0, L - q + j].
    """
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, context_len in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        num_new = end - begin
        if num_new == 0:
            continue
        keys = _gather_context(key_cache, block_tables[i], context_len)  # [L, num_kv_heads, head_dim]
        values = _gather_context(value_cache, block_tables[i], context_len)
        q = query[begin:end].transpose(0, 1)  # [num_heads, q, head_dim]
        k = keys.transpose(0, 1).to(query.dtype)  # [num_kv_heads, L, head_dim]
        v = values.transpose(0, 1).to(query.dtype)
        prefix_len = context_len - num_new
        # allowed[j, p] = p <= prefix_len + j
        rows = torch.arange(num_new, device=query.device)[:, None] + prefix_len
        allowed = torch.arange(context_len, device=query.device)[None, :] <= rows
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[begin:end] = o.transpose(0, 1)
    return out


def kv_pack(
    kv_cache: torch.Tensor,  # [num_layers, 2, N, B, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_blocks] int32/int64, the request's blocks holding the tokens, in order
    num_tokens: int,  # tokens to take, starting at offset 0 of block_ids[0]
    layer_start: int = 0,
    layer_end: int | None = None,
) -> torch.Tensor:  # [layer_end - layer_start, 2, num_tokens, num_kv_heads, head_dim], contiguous
    """Gather num_tokens tokens of KV from the given blocks, for a range of layers, into one buffer."""
    layers = kv_cache[layer_start:layer_end]
    block_size = kv_cache.shape[3]
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = layers.index_select(2, block_ids[:num_blocks].long())  # [nl, 2, nb, B, H, D]
    return blocks.flatten(2, 3)[:, :, :num_tokens].contiguous()


def kv_unpack(
    buffer: torch.Tensor,  # [num_layers_in_buffer, 2, num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_layers, 2, N, B, num_kv_heads, head_dim]
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
    flat = layers.flatten(2, 3)  # a view: [nl, 2, N * B, H, D]
    flat.index_copy_(2, slots, buffer.to(kv_cache.dtype))
