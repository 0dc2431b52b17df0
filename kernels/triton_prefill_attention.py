"""Triton paged prefill attention: a ragged batch of new tokens attends causally over each
sequence's cached prefix plus themselves, all read from the paged cache (new KV stored first).

Layout of the work:
  * grid = (query tiles, kv heads). A tile holds BLOCK_Q consecutive new tokens of one sequence times
    the GROUP query heads sharing the kv head, flattened into BLOCK_M = BLOCK_Q * GROUP (+ padding)
    rows, so each K/V tile feeds the whole group;
  * tiles are numbered without reading query_start_loc on the host: sequence i owns tiles
    [loc[i] // BLOCK_Q + i, loc[i + 1] // BLOCK_Q + i + 1), which always covers its rows; a program
    finds its sequence by binary search and exits if its tile is one of the spare ones;
  * K/V tiles are gathered through the block table position by position and combined with an online
    softmax in the log2 domain; keys past the tile's last query position are never read, nor (with a
    sliding window) keys before its first query's window.
Options as in kernels.reference: a soft cap bends each logit; a sink starts each row's softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    check_contiguous_1d,
    check_devices,
    check_last_dim_contiguous,
    check_paged_attention_args,
    check_shape,
    check_tensor,
)
from pdserve.kernels.triton_attention_options import LOG2E_CONST, AttentionOptions, soft_cap_logits
from pdserve.kernels.triton_utils import LOG2E, dot_precision, launch_options, load_kv_tile, next_pow2, upcast_for_dot

DEFAULT_BLOCK_M = 64  # query rows (tokens x group heads) per tile
DEFAULT_BLOCK_N = 64  # key positions per tile


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest sequence index i with loc[i] // BLOCK_Q + i <= tile (binary search)."""
    low = 0
    high = num_seqs
    while high - low > 1:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= tile
        low = tl.where(go_right, mid, low)
        high = tl.where(go_right, high, mid)
    return low


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, sinks_ptr,
    out_ptr, qk_scale, num_seqs, window, cap_in, cap_out,
    stride_q_t, stride_q_h,
    stride_k_n, stride_k_b, stride_k_h,
    stride_v_n, stride_v_b, stride_v_h,
    stride_bt_s,
    stride_o_t, stride_o_h,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    tile_begin = q_start + (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token of this tile
    if tile_begin >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - (q_end - q_start)

    rows = tl.arange(0, BLOCK_M)
    tokens = tile_begin + rows // GROUP  # [BLOCK_M]
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (tokens < q_end)
    q_positions = prefix_len + (tokens - q_start)  # context position of each row's token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]  # [BLOCK_M, HEAD_DIM_PAD]
    q_rows = query_ptr + tokens.to(tl.int64) * stride_q_t + heads * stride_q_h
    q = tl.load(q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys up to the tile's last query position: [kv_begin, kv_end).
    kv_end = tl.minimum(prefix_len + tl.minimum(tile_begin + BLOCK_Q, q_end) - q_start, seq_len)
    kv_begin = 0
    if HAS_WINDOW:  # the window of the tile's first query
        kv_begin = tl.maximum(prefix_len + tile_begin - q_start - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink is a first score with weight 1 and no value
        m_i = tl.load(sinks_ptr + heads).to(tl.float32) * LOG2E_CONST
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        positions = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_mask = positions < kv_end
        k, v = load_kv_tile(table_row, key_cache_ptr, value_cache_ptr, positions, pos_mask, dims, dim_mask,
                            kv_head, stride_k_n, stride_k_b, stride_k_h, stride_v_n, stride_v_b, stride_v_h,
                            BLOCK_SIZE, UPCAST)  # [BLOCK_N, HEAD_DIM_PAD] each

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if SOFT_CAP:
            scores = soft_cap_logits(scores, cap_in, cap_out)
        else:
            scores = scores * qk_scale
        visible = (positions[None, :] <= q_positions[:, None]) & pos_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (positions[None, :] > q_positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # Rows of spare tokens may see no key at all: keep their max finite so no NaN appears.
        m_new = tl.maximum(tl.maximum(m_i, tl.max(scores, 1)), -1e30)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.maximum(l_i, 1e-30)[:, None]
    out_rows = out_ptr + tokens.to(tl.int64) * stride_o_t + heads * stride_o_h
    tl.store(out_rows[:, None] + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def choose_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(block_m, block_n) keeping the pipelined tiles in shared memory on every GPU (<= ~100 KB)."""
    row_bytes = next_pow2(head_dim) * torch.finfo(dtype).bits // 8
    if row_bytes <= 256:  # fp16/bf16 up to head_dim 128
        return DEFAULT_BLOCK_M, DEFAULT_BLOCK_N
    if row_bytes <= 512:  # fp32 head_dim 128, fp16/bf16 head_dim 256
        return DEFAULT_BLOCK_M, DEFAULT_BLOCK_N // 2
    return DEFAULT_BLOCK_M // 2, DEFAULT_BLOCK_N // 4


def _check_prefill_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale) -> None:
    check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, decode=False)
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,), "[num_seqs + 1]")
    check_contiguous_1d("query_start_loc", query_start_loc)
    check_devices(("query", "query_start_loc"), (query, query_start_loc))


def launch_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim], written for every row owned by a sequence
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int | None = None,  # None: Triton's default
    num_stages: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> None:
    """Run the kernel into `out` with explicit tile sizes (tests use small ones)."""
    num_tokens, num_heads, head_dim = query.shape
    options = AttentionOptions.checked(sliding_window, soft_cap, sinks, query, scale)
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    check_shape("out", out, tuple(query.shape), "same as query")
    check_last_dim_contiguous("out", out)
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    block_m = max(block_m, next_pow2(group))  # a tile holds at least one token's whole group
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, options.sinks,
        out, float(scale) * LOG2E, num_seqs, options.window, options.cap_in, options.cap_out,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), BLOCK_SIZE=key_cache.shape[1],
        UPCAST=upcast_for_dot(query.dtype), PRECISION=dot_precision(query.dtype),
        HAS_WINDOW=options.has_window, SOFT_CAP=options.has_soft_cap, HAS_SINKS=options.has_sinks,
        **launch_options(num_warps, num_stages),
    )


def paged_prefill_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel of kernels.reference.paged_prefill_attention (arguments, shapes and result as there).

    Query row j of a sequence with q new tokens and context length L sits at position p = L - q + j and
    attends to positions [0, p], or (p - sliding_window, p] with a window.
    """
    _check_prefill_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    block_m, block_n = choose_tiles(query.shape[2], query.dtype)
    launch_prefill_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out, block_m, block_n,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
    )
    return out
