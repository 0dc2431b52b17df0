"""Sliding windows, logit soft-capping and attention sinks: kernels.reference (the CPU path) against a
dense per-sequence computation written from the definitions, and the Triton kernels against kernels.reference.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.triton_decode_attention import launch_decode_attention, paged_decode_attention
from pdserve.kernels.triton_prefill_attention import launch_prefill_attention, paged_prefill_attention
from tests.kernels.paged_data import (
    assert_close, generator_for, make_paged_cache, nan_like, query_start_loc, randn,
)

BLOCK = 4
# (sliding_window, soft_cap, with sinks)
OPTIONS = {
    "window": (5, None, False),
    "window-of-one": (1, None, False),
    "softcap": (None, 2.0, False),
    "sinks": (None, None, True),
    "window-softcap-sinks": (6, 3.0, True),
}


def dense_attention(
    query: torch.Tensor,  # [q, num_heads, head_dim], the last q positions of the sequence
    keys: torch.Tensor,  # [L, num_kv_heads, head_dim], the sequence's whole context
    values: torch.Tensor,
    scale: float, window: int | None, soft_cap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:  # [q, num_heads, head_dim]
    """softmax over [logits of visible keys, sink] of each head, applied to the visible values."""
    num_new, num_heads, _ = query.shape
    context_len, group = keys.shape[0], num_heads // keys.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for row in range(num_new):
        position = context_len - num_new + row
        low = 0 if window is None else max(0, position - window + 1)
        for head in range(num_heads):
            k = keys[low:position + 1, head // group].double()
            v = values[low:position + 1, head // group].double()
            logits = k @ query[row, head].double() * scale
            if soft_cap is not None:
                logits = soft_cap * torch.tanh(logits / soft_cap)
            if sinks is not None:
                logits = torch.cat((logits, sinks[head:head + 1].double()))
            probs = torch.softmax(logits, 0)[:k.shape[0]]
            out[row, head] = probs @ v
    return out


def _context(cache, seq: int) -> tuple[torch.Tensor, torch.Tensor]:  # ([L, Hkv, D], [L, Hkv, D])
    length, block_size = int(cache.seq_lens[seq]), cache.key_cache.shape[1]
    blocks = cache.block_tables[seq, :(length + block_size - 1) // block_size].long()
    return (cache.key_cache[blocks].flatten(0, 1)[:length], cache.value_cache[blocks].flatten(0, 1)[:length])


def _case(label: str, context_lens: list[int], new_lens: list[int], dtype=torch.float32, num_heads=4, head_dim=16):
    gen = generator_for(label)
    cache = make_paged_cache(context_lens, 2, head_dim, dtype, gen, block_size=BLOCK)
    query = randn((sum(new_lens), num_heads, head_dim), dtype, gen)
    sinks = randn((num_heads,), torch.float32, gen) * 2
    return cache, query, sinks


def _options(name: str, sinks: torch.Tensor) -> dict:
    window, soft_cap, with_sinks = OPTIONS[name]
    return {"sliding_window": window, "soft_cap": soft_cap, "sinks": sinks if with_sinks else None}


# Decode contexts: one token, inside the window, at its edge and well past it (several blocks).
DECODE_LENS = [1, 4, 5, 6, 13, 30]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_reference_decode_equals_dense(name, request):
    cache, query, sinks = _case(request.node.name, DECODE_LENS, [1] * len(DECODE_LENS))
    options = _options(name, sinks)
    out = reference.paged_decode_attention(query, cache.key_cache, cache.value_cache, cache.block_tables,
                                           cache.seq_lens, 0.25, **options)
    for seq in range(len(DECODE_LENS)):
        keys, values = _context(cache, seq)
        expected = dense_attention(query[seq:seq + 1], keys, values, 0.25, options["sliding_window"],
                                   options["soft_cap"], options["sinks"])
        torch.testing.assert_close(out[seq:seq + 1].double(), expected, atol=1e-5, rtol=1e-5)


# Prefill: a whole prompt longer than the window, a chunk after a cached prefix past the window, a short one.
PREFILL_CONTEXTS, PREFILL_NEW = [17, 23, 3], [17, 6, 3]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_reference_prefill_equals_dense(name, request):
    cache, query, sinks = _case(request.node.name, PREFILL_CONTEXTS, PREFILL_NEW)
    options = _options(name, sinks)
    loc = query_start_loc(PREFILL_NEW)
    out = reference.paged_prefill_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, loc,
                                            cache.seq_lens, 0.25, **options)
    for seq in range(len(PREFILL_NEW)):
        keys, values = _context(cache, seq)
        rows = slice(int(loc[seq]), int(loc[seq + 1]))
        expected = dense_attention(query[rows], keys, values, 0.25, options["sliding_window"], options["soft_cap"],
                                   options["sinks"])
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


def test_window_wider_than_every_context_changes_nothing(request):
    cache, query, _ = _case(request.node.name, DECODE_LENS, [1] * len(DECODE_LENS))
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.25)
    assert torch.equal(reference.paged_decode_attention(*args, sliding_window=64),
                       reference.paged_decode_attention(*args))


# ---------------------------------------------------------------------------------------------
# Triton kernels (interpreted on CPU) against kernels.reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("partition_size", [4096, 16])  # one partition, and split-K with unused partitions
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_decode_matches_reference(name, dtype, partition_size, request):
    cache, query, sinks = _case(request.node.name, DECODE_LENS + [0], [1] * (len(DECODE_LENS) + 1), dtype)
    options = _options(name, sinks)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.25)
    expected = reference.paged_decode_attention(*args, **options)
    out = nan_like(query)
    launch_decode_attention(*args, out, partition_size=partition_size, block_n=16, **options)
    assert_close(out, expected, dtype)
    assert_close(paged_decode_attention(*args, **options), expected, dtype)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_prefill_matches_reference(name, dtype, request):
    cache, query, sinks = _case(request.node.name, PREFILL_CONTEXTS, PREFILL_NEW, dtype)
    options = _options(name, sinks)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, query_start_loc(PREFILL_NEW),
            cache.seq_lens, 0.25)
    expected = reference.paged_prefill_attention(*args, **options)
    out = nan_like(query)
    launch_prefill_attention(*args, out, block_m=16, block_n=16, **options)
    assert_close(out, expected, dtype)
    assert_close(paged_prefill_attention(*args, **options), expected, dtype)
