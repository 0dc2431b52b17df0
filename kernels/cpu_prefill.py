"""Paged prefill attention in bfloat16 on the CPU's AVX512-BF16 (cpu_prefill_bf16.c, built by kernels.cpu_native):
every sequence's new query rows against its context read from the paged cache, causal, with an optional sliding
window, in one native call per layer.

`prefill_kernel()` is None where the kernel cannot run (no compiler, PDSERVE_CPU_KERNEL=torch, or a CPU without
AVX512-BF16); prefill then stays on kernels.torch_paged (a gather and torch's SDPA), as it does for float32, soft
caps and sinks.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels import cpu_native

SOURCE = Path(__file__).with_name("cpu_prefill_bf16.c")

_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_PREFILL = {"pdserve_prefill_bf16": (_INT, [_POINTER, ctypes.c_int64, _POINTER, _POINTER, _POINTER, _INT, _POINTER,
                                            _POINTER, _INT, _INT, _INT, _INT, _INT, _INT, _FLOAT, _POINTER, _INT])}


def prefill_kernel():
    """The loaded `pdserve_prefill_bf16` function, or None (see unavailable_reason)."""
    bound = cpu_native.functions(SOURCE, _PREFILL,
                                 ("pdserve_prefill_bf16_supported", "this CPU has no AVX512-BF16"))
    return None if bound is None else bound[0]


def unavailable_reason() -> str | None:
    prefill_kernel()  # binds the kernel, or records why it cannot
    return cpu_native.unavailable_reason(SOURCE)


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap: float | None,
             sinks: torch.Tensor | None) -> bool:
    """Whether paged_prefill takes these: bfloat16 on the CPU, contiguous caches of one shape, head_dim a multiple
    of 32 up to 256, no soft cap and no sinks."""
    head_dim = query.shape[-1]
    return (query.device.type == "cpu" and query.dtype == torch.bfloat16 and key_cache.dtype == torch.bfloat16
            and value_cache.dtype == torch.bfloat16 and key_cache.shape == value_cache.shape
            and key_cache.is_contiguous() and value_cache.is_contiguous() and head_dim == key_cache.shape[3]
            and head_dim % 32 == 0 and head_dim <= 256 and query.shape[1] % key_cache.shape[2] == 0
            and soft_cap is None and sinks is None and prefill_kernel() is not None)


def paged_prefill(
    query: torch.Tensor,  # [T, num_heads, head_dim] bfloat16, the new tokens of all sequences
    key_cache: torch.Tensor,  # [N, B, num_kv_heads, head_dim] bfloat16, the new tokens already stored
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, context length (prefix + new tokens)
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim] bfloat16
    num_tokens, num_heads, head_dim = query.shape
    q = query if cpu_native.heads_contiguous(query) else query.contiguous()  # q split from qkv: read in place
    tables, starts, lens = (cpu_native.int32_contiguous(t) for t in (block_tables, query_start_loc, seq_lens))
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    status = prefill_kernel()(q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
                              tables.shape[1], starts.data_ptr(), lens.data_ptr(), lens.shape[0], num_heads,
                              key_cache.shape[2], head_dim, key_cache.shape[1], sliding_window or 0, scale,
                              out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("the CPU prefill attention kernel could not allocate its packed keys and values")
    return out
