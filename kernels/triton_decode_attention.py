"""Triton paged decode attention: one query token per sequence over its paged KV context.

Layout of the work:
  * one program per (sequence, kv head, partition); the program handles all query heads that share
    the kv head (GQA group, padded to >= 16 rows for tl.dot), so each K/V tile is read once;
  * a partition is a contiguous range of context positions (split-K). With one partition the program
    writes the final output; with several, each writes a partial (max, sum, normalized out) and a
    second kernel merges the partials of each (sequence, query head);
  * K/V tiles of BLOCK_N positions are gathered through the block table position by position, so any
    cache block size works and a tile may span several cache blocks.
Scores are kept in the log2 domain (scale * log2(e) folded in) so the kernels use exp2.
Options (kernels.reference): a sliding window skips the positions before it (whole partitions too);
a soft cap bends each logit before the softmax; a sink starts the softmax with its logit and no value
(in the final merge when the context is split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import check_last_dim_contiguous, check_paged_attention_args, check_shape
from pdserve.kernels.triton_attention_options import LOG2E_CONST, AttentionOptions, soft_cap_logits
from pdserve.kernels.triton_utils import (
    LOG2E, cdiv, dot_precision, launch_options, load_kv_tile, next_pow2, upcast_for_dot,
)

DEFAULT_BLOCK_N = 64  # context positions per K/V tile (32 for rows wider than 256 bytes)
MIN_PARTITION_SIZE = 512  # shortest context range worth a separate program
MAX_PARTITIONS = 16  # bounds the partial-result buffers for very long contexts


@triton.jit
def _decode_partition_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, num_partitions, window, cap_in, cap_out,
    stride_q_s, stride_q_h,
    stride_k_n, stride_k_b, stride_k_h,
    stride_v_n, stride_v_b, stride_v_h,
    stride_bt_s,
    stride_o_s, stride_o_h,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + rows  # [GROUP_PAD]
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    out_mask = row_mask[:, None] & dim_mask[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
    if start >= seq_len:
        if not SPLIT:
            # Only an empty sequence (seq_len <= 0, e.g. batch padding) gets here: write zeros.
            out_rows = out_ptr + seq.to(tl.int64) * stride_o_s + heads[:, None] * stride_o_h
            zeros = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
            tl.store(out_rows + dims[None, :], zeros, mask=out_mask)
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    if HAS_WINDOW:
        window_start = tl.maximum(seq_len - window, 0)
        if end <= window_start:  # the whole partition left the window: the merge skips it
            return
        start = tl.maximum(start, window_start)

    q_rows = query_ptr + seq.to(tl.int64) * stride_q_s + heads[:, None] * stride_q_h
    q = tl.load(q_rows + dims[None, :], mask=out_mask, other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(score - max)
    if HAS_SINKS and not SPLIT:  # the sink is a first score with weight 1 and no value
        m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * LOG2E_CONST
        l_i += 1.0
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_mask = positions < end
        k, v = load_kv_tile(table_row, key_cache_ptr, value_cache_ptr, positions, pos_mask, dims, dim_mask,
                            kv_head, stride_k_n, stride_k_b, stride_k_h, stride_v_n, stride_v_b, stride_v_h,
                            BLOCK_SIZE, UPCAST)  # [BLOCK_N, HEAD_DIM_PAD] each

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [GROUP_PAD, BLOCK_N]
        if SOFT_CAP:
            scores = soft_cap_logits(scores, cap_in, cap_out)
        else:
            scores = scores * qk_scale
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    if SPLIT:
        # Partials are laid out [S, NUM_HEADS, num_partitions] (+ [HEAD_DIM] for the output).
        part_index = (seq.to(tl.int64) * NUM_HEADS + heads) * num_partitions + part  # [GROUP_PAD]
        tl.store(part_max_ptr + part_index, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part_index, l_i, mask=row_mask)
        tl.store(part_out_ptr + part_index[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
    else:
        out_rows = out_ptr + seq.to(tl.int64) * stride_o_s + heads[:, None] * stride_o_h
        tl.store(out_rows + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, sinks_ptr,
    num_partitions, window, stride_o_s, stride_o_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # One program per (sequence, query head): merges that row's partials with an online softmax.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(tl.maximum(seq_len, 0), PARTITION_SIZE)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    base = (seq.to(tl.int64) * NUM_HEADS + head) * num_partitions

    m = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.full([], 0.0, dtype=tl.float32)
    if HAS_SINKS:  # the sink is a first partial with weight 1 and no value
        m = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_CONST
        total += 1.0
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    first_used = 0
    if HAS_WINDOW:  # partitions before the window wrote nothing
        first_used = tl.maximum(seq_len - window, 0) // PARTITION_SIZE
    for part in range(first_used, num_used):
        part_max = tl.load(part_max_ptr + base + part)
        part_sum = tl.load(part_sum_ptr + base + part)
        part_out = tl.load(part_out_ptr + (base + part) * HEAD_DIM + dims, mask=dim_mask, other=0.0)
        m_new = tl.maximum(m, part_max)
        old_weight = tl.exp2(m - m_new)
        new_weight = part_sum * tl.exp2(part_max - m_new)
        acc = acc * old_weight + part_out * new_weight
        total = total * old_weight + new_weight
        m = m_new
    result = tl.where(total > 0.0, acc / tl.maximum(total, 1e-30), 0.0)  # empty sequence -> zeros
    out_row = out_ptr + seq.to(tl.int64) * stride_o_s + head * stride_o_h
    tl.store(out_row + dims, result.to(out_ptr.dtype.element_ty), mask=dim_mask)


def choose_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Tile width keeping the pipelined K/V tiles in shared memory on every GPU (<= ~100 KB)."""
    row_bytes = next_pow2(head_dim) * torch.finfo(dtype).bits // 8
    return DEFAULT_BLOCK_N if row_bytes <= 256 else DEFAULT_BLOCK_N // 2


def choose_partition_size(max_context: int, block_n: int = DEFAULT_BLOCK_N) -> int:
    """Context positions per split-K partition: at least MIN_PARTITION_SIZE, at most MAX_PARTITIONS
    partitions, a multiple of block_n. Contexts up to MIN_PARTITION_SIZE run unsplit."""
    size = max(MIN_PARTITION_SIZE, cdiv(max_context, MAX_PARTITIONS))
    return cdiv(size, block_n) * block_n


def launch_decode_attention(
    query: torch.Tensor,  # [S, num_heads, head_dim]
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    out: torch.Tensor,  # [S, num_heads, head_dim], written
    partition_size: int,  # multiple of block_n; >= max context means no split
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int | None = None,  # None: Triton's default; experiments/gpu_kernels.py --sweep tries others
    num_stages: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> None:
    """Run the kernels into `out` with explicit tiling (tests force small partitions here)."""
    num_seqs, num_heads, head_dim = query.shape
    options = AttentionOptions.checked(sliding_window, soft_cap, sinks, query, scale)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    check_shape("out", out, tuple(query.shape), "same as query")
    check_last_dim_contiguous("out", out)
    if partition_size <= 0 or partition_size % block_n != 0:
        raise ValueError(f"partition_size={partition_size} must be a positive multiple of block_n={block_n}")
    if num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    num_partitions = max(1, cdiv(max_context, partition_size))
    split = num_partitions > 1
    head_dim_pad = next_pow2(head_dim)
    if split:
        partials = (num_seqs, num_heads, num_partitions)
        part_out = torch.empty((*partials, head_dim), dtype=torch.float32, device=query.device)
        part_max = torch.empty(partials, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused by the kernel when SPLIT is False
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, key_cache, value_cache, block_tables, seq_lens, options.sinks,
        out, part_out, part_max, part_sum,
        float(scale) * LOG2E, num_partitions, options.window, options.cap_in, options.cap_out,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, PARTITION_SIZE=partition_size, SPLIT=split,
        UPCAST=upcast_for_dot(query.dtype), PRECISION=dot_precision(query.dtype),
        HAS_WINDOW=options.has_window, SOFT_CAP=options.has_soft_cap, HAS_SINKS=options.has_sinks,
        **launch_options(num_warps, num_stages),
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens, options.sinks,
            num_partitions, options.window, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            PARTITION_SIZE=partition_size, HAS_WINDOW=options.has_window, HAS_SINKS=options.has_sinks,
        )


def paged_decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel of kernels.reference.paged_decode_attention (arguments, shapes and result as there).

    The number of split-K partitions follows the context the block tables can hold
    (max_blocks * block_size), so pass block tables trimmed to the batch's longest sequence.
    Sequences with seq_len 0 (padding) get zeros.
    """
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, decode=True)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    max_context = block_tables.shape[1] * key_cache.shape[1]
    block_n = choose_block_n(query.shape[2], query.dtype)
    launch_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, out,
        partition_size=choose_partition_size(max_context, block_n), block_n=block_n,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
    )
    return out
