"""Random paged-cache fixtures for the kernel tests: caches, shuffled block tables, tolerances."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

# (atol, rtol) per dtype: fp32 must match the reference to rounding; half types to ~1e-2.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def generator_for(label: str) -> torch.Generator:
    """A generator seeded from a case label: fresh data per case, reproducible per run."""
    return torch.Generator().manual_seed(zlib.crc32(label.encode()))


def randn(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def nan_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert not torch.isnan(actual).any(), "the kernel left NaN (unwritten) elements in its output"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedCache:
    key_cache: torch.Tensor  # [N, B, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [N, B, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [S, max_blocks] int32, random blocks past each sequence's own
    seq_lens: torch.Tensor  # [S] int32


def make_block_tables(
    context_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:  # [S, max_blocks] int32
    """Each sequence gets distinct blocks drawn from a shuffled pool (never contiguous or sorted).
    Entries past a sequence's blocks hold random blocks (often another sequence's): a kernel that
    reads past seq_len picks up wrong data and disagrees with the reference."""
    needed = [(length + block_size - 1) // block_size for length in context_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed but the pool has {num_blocks}")
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(max(needed), 1) + 1  # one spare column: tables are wider than needed
    table = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen, dtype=torch.int32)
    for seq, count in enumerate(needed):
        table[seq, :count] = torch.tensor(pool[:count], dtype=torch.int32)
        pool = pool[count:]
    return table


def make_paged_cache(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    block_size: int = 16,
    spare_blocks: int = 3,
) -> PagedCache:
    """A random K/V cache (every slot random, used or not) with a table per sequence."""
    num_blocks = sum((n + block_size - 1) // block_size for n in context_lens) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedCache(
        key_cache=randn(shape, dtype, gen),
        value_cache=randn(shape, dtype, gen),
        block_tables=make_block_tables(context_lens, block_size, num_blocks, gen),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
    )


def query_start_loc(num_new_tokens: list[int]) -> torch.Tensor:  # [S + 1] int32
    loc = torch.zeros(len(num_new_tokens) + 1, dtype=torch.int32)
    loc[1:] = torch.tensor(num_new_tokens, dtype=torch.int32).cumsum(0)
    return loc
