"""The torch (CPU) implementation of KV store and paged attention, split into a per-step plan and a
per-layer run.

Everything derived from the step's metadata alone (gather indices, masks, host-side lengths) is the
same for every layer, so the engine's torch-paged attention backend builds each plan once per step
(engine/attention/torch_paged.py) and every layer only runs it. kernels.reference composes plan +
run into the plain kernel signatures that the Triton kernels are tested against.

Shapes as in kernels.reference: caches [N, B, num_kv_heads, head_dim], block tables [S, max_blocks].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StorePlan:
    slots: torch.Tensor  # [T'] int64, the cache slots of the tokens that are stored
    keep: torch.Tensor | None  # [T] bool, which tokens are stored; None = all of them


def plan_store(slot_mapping: torch.Tensor) -> StorePlan:  # slot_mapping [T]; negative = skip
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return StorePlan(slot_mapping.long(), None)
    return StorePlan(slot_mapping[keep].long(), keep)


def store_kv_planned(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: StorePlan,
) -> None:
    if plan.keep is not None:
        key, value = key[plan.keep], value[plan.keep]
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    # view (never a copy): the writes must land in the cache itself
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, plan.slots, key.to(key_cache.dtype))
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, plan.slots, value.to(value_cache.dtype))


@dataclass(frozen=True)
class DecodePlan:
    num_seqs: int
    max_len: int  # longest context of the step
    block_ids: torch.Tensor  # [S * ceil(max_len / B)] int64, every sequence's blocks, row by row
    mask: torch.Tensor | None  # [S, 1, 1, max_len] bool; None when every context is max_len long
    any_empty: bool  # a padding sequence with no context (attends to nothing: zeros)


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> DecodePlan:
    """block_tables [S, max_blocks] int32, seq_lens [S] int32 (context including the new token)."""
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    num_blocks = (max_len + block_size - 1) // block_size
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()
    mask = None
    if bool((seq_lens != max_len).any()):  # shorter sequences must not see the padded tail
        mask = (torch.arange(max_len, device=seq_lens.device)[None, :] < seq_lens[:, None])[:, None, None, :]
    return DecodePlan(int(seq_lens.shape[0]), max_len, block_ids, mask, bool((seq_lens == 0).any()))


def decode_attention_planned(
    query: torch.Tensor,  # [S, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [S, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    if plan.max_len == 0:
        return torch.zeros_like(query)
    # Whole blocks of every sequence in one gather, viewed [S, num_kv_heads, max_len, head_dim]; SDPA
    # (4-D, so torch's fused CPU kernel) does the rest, GQA included.
    keys = _gather_padded(key_cache, plan.block_ids, num_seqs, plan.max_len)
    values = _gather_padded(value_cache, plan.block_ids, num_seqs, plan.max_len)
    out = F.scaled_dot_product_attention(
        query.float().view(num_seqs, num_heads, 1, head_dim), keys, values, attn_mask=plan.mask, scale=scale,
        enable_gqa=num_heads != key_cache.shape[2],
    )  # [S, num_heads, 1, head_dim]
    if plan.any_empty:
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


@dataclass(frozen=True)
class PrefillSequence:
    begin: int  # the sequence's query rows are [begin, end) of the prefill tokens
    end: int
    context_len: int  # cached prefix + this step's new tokens
    block_ids: torch.Tensor  # [ceil(context_len / B)] int64
    mask: torch.Tensor | None  # [1, 1, q, context_len] bool; None = plain causal (no cached prefix)


def plan_prefill(
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_size: int,
) -> list[PrefillSequence]:
    """Query row j of a sequence with q new tokens and context length L sits at position L - q + j and
    attends to positions [0, L - q + j]."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    plan = []
    for i, context_len in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        if end == begin:
            continue
        num_blocks = (context_len + block_size - 1) // block_size
        prefix_len = context_len - (end - begin)
        mask = None
        if prefix_len > 0:  # torch's is_causal aligns to the top left, so a prefix needs a real mask
            rows = torch.arange(end - begin, device=seq_lens.device)[:, None] + prefix_len
            mask = (torch.arange(context_len, device=seq_lens.device)[None, :] <= rows)[None, None]
        plan.append(PrefillSequence(begin, end, context_len, block_tables[i, :num_blocks].long(), mask))
    return plan


def prefill_attention_planned(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of all sequences, concatenated
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim], new tokens already stored
    value_cache: torch.Tensor,
    plan: list[PrefillSequence],
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    out = torch.empty_like(query)
    gqa = query.shape[1] != key_cache.shape[2]
    for seq in plan:
        q = query[seq.begin:seq.end].transpose(0, 1)[None]  # [1, num_heads, q, head_dim]
        k = _gather_context(key_cache, seq.block_ids, seq.context_len).to(query.dtype)  # [1, Hkv, L, D]
        v = _gather_context(value_cache, seq.block_ids, seq.context_len).to(query.dtype)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=gqa
        )  # [1, num_heads, q, head_dim]; 4-D inputs take torch's fused CPU kernel
        out[seq.begin:seq.end] = o[0].transpose(0, 1)
    return out


def _gather_context(
    cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_blocks] int64 (one sequence)
    context_len: int,
) -> torch.Tensor:  # [1, num_kv_heads, context_len, head_dim]
    blocks = cache.index_select(0, block_ids)
    return blocks.flatten(0, 1)[:context_len].transpose(0, 1)[None]
