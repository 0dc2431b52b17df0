"""Argument checks shared by the Triton wrappers: each failure is a ValueError that names the
argument, what it is, and what the kernel expects.

Only host-side metadata is read (shape, stride, dtype, device): no check synchronizes with the GPU.
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_utils import INTERPRET

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    tensor: object,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """`tensor` is a torch.Tensor with `ndim` dimensions and one of `dtypes`."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of {names}")


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int | None, ...], meaning: str) -> None:
    """Each non-None entry of `expected` must equal the tensor's size there; `meaning` names the dims."""
    for actual, wanted in zip(tensor.shape, expected, strict=True):
        if wanted is not None and actual != wanted:
            shown = tuple("*" if w is None else w for w in expected)
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {shown} ({meaning})")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} has stride {tensor.stride(-1)} in its last dimension; the kernel reads head_dim "
            f"contiguously: pass {name}.contiguous()"
        )


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} (strides {tensor.stride()}) must be contiguous: pass {name}.contiguous()")


def check_contiguous_1d(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() > 1 and tensor.stride(0) != 1:
        raise ValueError(
            f"{name} must be contiguous (stride 1), got stride {tensor.stride(0)}: pass {name}.contiguous()"
        )


def check_same_dtype(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        shown = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors, strict=True))
        raise ValueError(f"dtypes differ ({shown}); the kernel needs one dtype: cast them to match")


def check_devices(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """All tensors on one device, and that device runs Triton (CUDA, or CPU under the interpreter)."""
    first = tensors[0].device
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.device != first:
            raise ValueError(
                f"{name} is on {tensor.device} but {names[0]} is on {first}: move them to one device"
            )
    if first.type == "cuda" or (first.type == "cpu" and INTERPRET):
        return
    raise ValueError(
        f"{names[0]} is on {first}: the Triton kernels need CUDA tensors (CPU tensors only under "
        f"TRITON_INTERPRET=1 set before triton is imported); use the torch kernels in "
        f"pdserve.kernels.reference for {first.type} tensors"
    )


def check_scale(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a Python float, got {type(value).__name__}")


def check_paged_attention_args(query, key_cache, value_cache, block_tables, seq_lens, scale, decode: bool) -> None:
    """What decode and prefill attention share: query [*, num_heads, head_dim], caches
    [N, B, num_kv_heads, head_dim] of query's dtype, int32 block_tables [S, max_blocks] and seq_lens [S].
    For decode, S is query's row count (one token per sequence); for prefill, seq_lens' length."""
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    cache_dims = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_shape("key_cache", key_cache, (None, None, None, head_dim), cache_dims)
    check_shape("value_cache", value_cache, tuple(key_cache.shape), "same as key_cache")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads and key_cache {num_kv_heads} kv heads: num_heads must be a "
            f"multiple of num_kv_heads"
        )
    if decode:
        check_shape("seq_lens", seq_lens, (query.shape[0],), "[num_seqs]: one entry per query row")
    check_shape("block_tables", block_tables, (seq_lens.shape[0], None), "[num_seqs, max_blocks]")
    check_same_dtype(("query", "key_cache", "value_cache"), (query, key_cache, value_cache))
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, tensor)
    check_last_dim_contiguous("block_tables", block_tables)
    check_contiguous_1d("seq_lens", seq_lens)
    check_scale("scale", scale)
    check_devices(
        ("query", "key_cache", "value_cache", "block_tables", "seq_lens"),
        (query, key_cache, value_cache, block_tables, seq_lens),
    )


def check_non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative int")
