"""The torch (CPU) implementation of KV store and paged attention, split into a per-step plan and a
per-layer run.

Everything derived from the step's metadata alone (gather indices, masks, host-side lengths) is the
same for every layer, so the engine's torch-paged attention backend builds each plan once per step
(engine/attention/torch_paged.py) and every layer only runs it. Decode groups the step's sequences by
length (group_by_length), so padding to a group's longest context stays small. kernels.reference
composes plan + run into the plain kernel signatures that the Triton kernels are tested against.

Shapes as in kernels.reference: caches [N, B, num_kv_heads, head_dim], block tables [S, max_blocks].
A sliding window W lets the query at position p see keys (p - W, p]; the plans for a window gather only
the blocks a window can reach. Soft-capped logits (cap * tanh(logit / cap)) and sinks (one extra logit
per head in the softmax denominator, with no value) take an explicit softmax in prefill.
Decode gathers K and V row by row (one KV head of one slot), in the cache's dtype, straight into
[(sequence, KV head), positions, head_dim] buffers that every layer of the step reuses, and attends in
float32 (bf16 K/V are upcast) with two batched matmuls around a softmax; the query heads that share a KV
head are its query rows. Prefill attends in the query's dtype (SDPA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.kernels.length_groups import group_by_length


# Decode gathers at most about this many float32 elements of keys at a time (then as many of values; at least
# one sequence), so a chunk is still in the core's cache when its matmuls read it: 1.5 MB, 2,048 positions of
# 3 KV heads of 64 (experiments/cpu_attention_dtype.py times it).
DECODE_CHUNK_ELEMENTS = 2048 * 3 * 64
# MLA's decode (engine/layers/mla.py) gathers at most about this many positions of latents at a time.
DECODE_CHUNK_TOKENS = 2048


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
class DecodeGroup:
    num_seqs: int
    max_len: int  # the group's longest context; 0: sequences with no context (attend to nothing: zeros)
    first_pos: int  # context position of the first gathered key (a multiple of B; 0 without a window)
    block_ids: torch.Tensor  # [num_seqs * blocks] int64, the group's blocks from first_pos // B, row by row
    mask: torch.Tensor | None  # [num_seqs, 1, 1, max_len - first_pos] float32, 0 or -inf; None: all visible
    # head_rows' results by (num_kv_heads, block_size), made by the first layer that reads them
    _head_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def span(self) -> int:  # gathered positions per sequence
        return self.max_len - self.first_pos

    def head_rows(self, num_kv_heads: int, block_size: int) -> torch.Tensor:  # [num_seqs, num_kv_heads, span]
        """Row (slot * num_kv_heads + head) of each gathered key in a cache viewed as [N * B * num_kv_heads,
        head_dim], head by head: what decode gathers K and V with, straight into [(seq, head), span, D]."""
        key = (num_kv_heads, block_size)
        if key not in self._head_rows:
            in_block = _rows_in_block(num_kv_heads, block_size, self.block_ids.device)  # [1, Hkv, 1, B]
            rows = self.block_ids.view(self.num_seqs, 1, -1, 1) * in_block.numel() + in_block
            rows = rows.flatten(2)  # [s, num_kv_heads, blocks * B]
            self._head_rows[key] = rows[:, :, :self.span].contiguous()
        return self._head_rows[key]


@functools.lru_cache(maxsize=16)
def _rows_in_block(num_kv_heads: int, block_size: int, device: torch.device) -> torch.Tensor:  # [1, Hkv, 1, B]
    """Within a block, the row of head h at offset b: b * num_kv_heads + h."""
    return torch.arange(block_size * num_kv_heads, device=device).view(block_size, -1).t().contiguous()[None, :, None]


@dataclass(frozen=True)
class DecodePlan:
    num_seqs: int
    groups: tuple[DecodeGroup, ...]  # in the order of `order`
    order: torch.Tensor | None  # [S] int64, the step's sequence indices group by group; None: step order
    restore: torch.Tensor | None  # [S] int64, the inverse of order (group rows -> step rows)
    # gather buffers by cache (dtype, device, num_kv_heads, head_dim): made by the first layer, reused by the rest
    _workspaces: dict[tuple, DecodeWorkspace] = field(default_factory=dict, compare=False, repr=False)

    @property
    def any_empty(self) -> bool:  # a padding sequence with no context
        return self.groups[-1].max_len == 0 if self.groups else False

    def workspace(self, cache: torch.Tensor) -> DecodeWorkspace:
        key = (cache.dtype, cache.device, *cache.shape[2:])
        if key not in self._workspaces:
            self._workspaces[key] = DecodeWorkspace(self.groups, cache)
        return self._workspaces[key]


def plan_decode(
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context including the new token
    block_size: int,
    groups: list[list[int]] | None = None,  # sequence indices per group; None: group_by_length's
    sliding_window: int | None = None,  # None: each query sees its whole context
) -> DecodePlan:
    """The step's sequences in groups (by default group_by_length's), each group's gather indices and
    mask. One group keeps the step's order (nothing to reorder)."""
    lens = seq_lens.tolist()
    index_groups = group_by_length(lens) if groups is None else groups
    if len(index_groups) == 1:
        index_groups = [list(range(len(lens)))]
    order_list = [index for group in index_groups for index in group]
    if order_list == list(range(len(lens))):
        order = restore = None
    else:
        order = torch.tensor(order_list, dtype=torch.int64, device=seq_lens.device)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(len(order_list), device=seq_lens.device)
    single = len(index_groups) == 1 and order is None  # the whole step as it is: no index tensors needed
    groups = tuple(_plan_group(block_tables, seq_lens, None if single else group, [lens[i] for i in group],
                               block_size, sliding_window) for group in index_groups)
    return DecodePlan(len(lens), groups, order, restore)


def _plan_group(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, indices: list[int] | None, lens: list[int], block_size: int,
    sliding_window: int | None,
) -> DecodeGroup:  # indices None: every sequence of the step, in step order
    max_len = max(lens)
    num_blocks = (max_len + block_size - 1) // block_size
    window = sliding_window if sliding_window is not None and sliding_window < max_len else None
    first_block = 0 if window is None else max(0, min(lens) - window) // block_size
    first_pos = first_block * block_size
    rows = block_tables if indices is None else block_tables[torch.tensor(indices, device=block_tables.device)]
    group_lens = seq_lens if indices is None else seq_lens[torch.tensor(indices, device=seq_lens.device)]
    mask = None
    if min(lens) != max_len or window is not None:  # hide the padded tail and what left the window
        positions = torch.arange(first_pos, max_len, device=seq_lens.device)[None, :]
        hidden = positions >= group_lens[:, None]
        if window is not None:
            hidden |= positions < group_lens[:, None] - window
        # additive: decode adds it to its logits, and SDPA (MLA's decode) takes it as it is
        mask = torch.zeros(hidden.shape, device=seq_lens.device).masked_fill_(hidden, float("-inf"))[:, None, None]
    return DecodeGroup(len(lens), max_len, first_pos, rows[:, first_block:num_blocks].reshape(-1).long(), mask)


def decode_attention_planned(
    query: torch.Tensor,  # [S, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], one logit per head
) -> torch.Tensor:  # [S, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if not plan.groups:
        return torch.zeros_like(query)
    rows = query if plan.order is None else query.index_select(0, plan.order)  # [S, num_heads, head_dim]
    # under GQA the query heads that share a KV head are that head's query rows: [S * Hkv, group, D]
    rows = (rows.float() * scale).view(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = (torch.zeros if plan.any_empty else torch.empty)(rows.shape, device=query.device)  # empty: zeros
    sink_logits = None if sinks is None else sinks.float().view(1, num_kv_heads, -1, 1)
    workspace = plan.workspace(key_cache)
    begin = 0
    for group in plan.groups:
        if group.max_len > 0:
            first, count = begin * num_kv_heads, group.num_seqs * num_kv_heads
            _attend_group(_rows(rows, first, count), _rows(out, first, count), key_cache, value_cache, group,
                          soft_cap, sink_logits, workspace)
        begin += group.num_seqs
    out = out.view(num_seqs, num_heads, head_dim)
    if plan.restore is not None:
        out = out.index_select(0, plan.restore)
    return out.to(query.dtype)


class DecodeWorkspace:
    """A step's decode gather buffers, reused by every layer and chunk, for a chunk's keys and then its
    values: rows of the cache gathered in its dtype, and (for other dtypes than float32) their float32 copy."""

    def __init__(self, groups: tuple[DecodeGroup, ...], cache: torch.Tensor) -> None:
        most = max((min(group.num_seqs, _seqs_per_chunk(group, cache)) * group.span
                    for group in groups if group.span > 0), default=0)
        shape = (most * cache.shape[2], cache.shape[3])  # [rows, head_dim]
        self.float32 = torch.empty(shape, device=cache.device)
        self.gathered = self.float32 if cache.dtype == torch.float32 else cache.new_empty(shape)

    def gather(self, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [len(rows), head_dim] float32
        num_rows = rows.numel()
        flat = cache.view(-1, cache.shape[-1])  # [N * B * num_kv_heads, head_dim]
        gathered = torch.index_select(flat, 0, rows, out=_rows(self.gathered, 0, num_rows))
        return gathered if gathered.dtype == torch.float32 else _rows(self.float32, 0, num_rows).copy_(gathered)


def _seqs_per_chunk(group: DecodeGroup, cache: torch.Tensor) -> int:  # cache [N, B, num_kv_heads, head_dim]
    return max(1, DECODE_CHUNK_ELEMENTS // (group.span * cache.shape[2] * cache.shape[3]))


def _attend_group(
    q: torch.Tensor,  # [s * num_kv_heads, group, head_dim] float32, already scaled
    out: torch.Tensor,  # [s * num_kv_heads, group, head_dim] float32, written
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    group: DecodeGroup,
    soft_cap: float | None,
    sink_logits: torch.Tensor | None,  # [1, num_kv_heads, group, 1] float32
    workspace: DecodeWorkspace,
) -> None:
    """One group, a chunk of its sequences at a time (about DECODE_CHUNK_ELEMENTS of keys): each chunk
    gathers its keys into float32 [(seq, KV head), span, D] rows, takes logits and softmax, then gathers
    its values into the same buffer while the chunk is still in the core's cache."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    head_rows = group.head_rows(num_kv_heads, key_cache.shape[1])  # [s, Hkv, span]
    per_chunk = _seqs_per_chunk(group, key_cache)
    for first in range(0, group.num_seqs, per_chunk):
        count = min(per_chunk, group.num_seqs - first)
        rows = _rows(head_rows, first, count).view(-1)
        pairs = (first * num_kv_heads, count * num_kv_heads)
        keys = workspace.gather(key_cache, rows).view(count * num_kv_heads, group.span, head_dim)
        logits = torch.bmm(_rows(q, *pairs), keys.transpose(1, 2))  # [c * Hkv, group, span]
        mask = None if group.mask is None else _rows(group.mask, first, count).view(count, 1, group.span)
        probs = _decode_softmax(logits, mask, soft_cap, sink_logits, count)
        values = workspace.gather(value_cache, rows).view(count * num_kv_heads, group.span, head_dim)
        torch.bmm(probs, values, out=_rows(out, *pairs))


def _rows(tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """tensor's rows [first, first + count): the tensor itself when that is all of it (a slice costs a call)."""
    return tensor if first == 0 and count == tensor.shape[0] else tensor.narrow(0, first, count)


def _decode_softmax(
    logits: torch.Tensor,  # [c * num_kv_heads, group, span] float32, overwritten
    mask: torch.Tensor | None,  # [c, 1, span] float32, 0 or -inf
    soft_cap: float | None,
    sink_logits: torch.Tensor | None,  # [1, num_kv_heads, group, 1]
    count: int,
) -> torch.Tensor:  # [c * num_kv_heads, group, span]
    if soft_cap is not None:
        logits = logits.div_(soft_cap).tanh_().mul_(soft_cap)
    if mask is not None:
        logits.view(count, -1, logits.shape[-1]).add_(mask)
    if sink_logits is None:
        return torch.softmax(logits, dim=-1)
    sink = sink_logits.expand(count, -1, -1, -1).reshape(-1, logits.shape[1], 1)
    return torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]


@dataclass(frozen=True)
class PrefillSequence:
    begin: int  # the sequence's query rows are [begin, end) of the prefill tokens
    end: int
    context_len: int  # cached prefix + this step's new tokens
    first_pos: int  # context position of the first gathered key (a multiple of B; 0 without a window)
    block_ids: torch.Tensor  # [ceil(context_len / B) - first_pos // B] int64
    mask: torch.Tensor | None  # [1, 1, q, context_len - first_pos] bool; None = plain causal from position 0


def plan_prefill(
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_size: int,
    sliding_window: int | None = None,  # None: each query sees its whole context
) -> list[PrefillSequence]:
    """Query row j of a sequence with q new tokens and context length L sits at position p = L - q + j and
    attends to positions [0, p], or (p - sliding_window, p] with a window."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    plan = []
    for i, context_len in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        if end == begin:
            continue
        num_blocks = (context_len + block_size - 1) // block_size
        prefix_len = context_len - (end - begin)
        window = sliding_window if sliding_window is not None and sliding_window < context_len else None
        first_block = 0 if window is None else max(0, prefix_len - window + 1) // block_size
        first_pos = first_block * block_size
        mask = None
        if prefix_len > 0 or window is not None:  # torch's is_causal aligns to the top left: a real mask
            rows = torch.arange(end - begin, device=seq_lens.device)[:, None] + prefix_len
            keys = torch.arange(first_pos, context_len, device=seq_lens.device)[None, :]
            visible = keys <= rows
            if window is not None:
                visible &= keys > rows - window
            mask = visible[None, None]
        block_ids = block_tables[i, first_block:num_blocks].long()
        plan.append(PrefillSequence(begin, end, context_len, first_pos, block_ids, mask))
    return plan


def prefill_attention_planned(
    query: torch.Tensor,  # [T, num_heads, head_dim], the new tokens of all sequences, concatenated
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim], new tokens already stored
    value_cache: torch.Tensor,
    plan: list[PrefillSequence],
    scale: float,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], one logit per head
) -> torch.Tensor:  # [T, num_heads, head_dim]
    out = torch.empty_like(query)
    gqa = query.shape[1] != key_cache.shape[2]
    for seq in plan:
        q = query[seq.begin:seq.end].transpose(0, 1)[None]  # [1, num_heads, q, head_dim]
        span = seq.context_len - seq.first_pos
        k = _gather_context(key_cache, seq.block_ids, span).to(query.dtype)  # [1, Hkv, span, D]
        v = _gather_context(value_cache, seq.block_ids, span).to(query.dtype)
        o = attend(q, k, v, seq.mask, seq.mask is None, scale, soft_cap, sinks, gqa)  # [1, num_heads, q, head_dim]
        out[seq.begin:seq.end] = o[0].transpose(0, 1)
    return out


def _gather_context(
    cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [num_blocks] int64 (one sequence)
    span: int,  # positions to keep, from the first block
) -> torch.Tensor:  # [1, num_kv_heads, span, head_dim]
    blocks = cache.index_select(0, block_ids)
    return blocks.flatten(0, 1)[:span].transpose(0, 1)[None]


def attend(
    q: torch.Tensor,  # [s, num_heads, q, head_dim]
    k: torch.Tensor,  # [s, num_kv_heads, L, head_dim]
    v: torch.Tensor,  # [s, num_kv_heads, L, head_dim]
    mask: torch.Tensor | None,  # broadcast to [s, num_heads, q, L]: bool (True = visible) or additive
    causal: bool,  # no mask: query row i sees keys [0, i] (True) or every key (False)
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None,  # [num_heads]
    gqa: bool,
) -> torch.Tensor:  # [s, num_heads, q, head_dim]
    """SDPA (4-D inputs take torch's fused CPU kernel), or an explicit softmax for soft-caps and sinks."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [s, H, q, L]
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    if mask is None and causal:
        mask = torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device).tril_()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
