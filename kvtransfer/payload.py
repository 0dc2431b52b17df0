"""Payload frames of the KV link: flat byte views of tensors, tensor views of frames, checksums.

A KVLayer payload has the layout of `kernels.reference.kv_pack`:
    [layer_end - layer_start, planes, num_tokens, *per_token]   engine KV dtype; planes 2 is K then V
    ([.., num_kv_heads, head_dim]), 1 is a latent ([.., 1, width], MLA).

torch is imported only by the tensor helpers, so a process that only speaks the protocol (the
router) does not load it.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import xxhash

from pdserve.control.errors import ProtocolError

# KV dtypes by torch attribute name, with their size in bytes.
DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
KVDtype = Literal[tuple(DTYPE_SIZES)]  # type: ignore[valid-type]  # one of the names above


# ---- checksums ----

def payload_checksum(buffer: Any) -> int:
    """64-bit XXH3 of one payload frame's bytes (python-xxhash), in one pass at memory speed.

    Catches corrupted, truncated, stale or misplaced bytes; it is not an authenticator (CURVE's MAC
    is). Why XXH3 and not zlib.crc32: on the 2-core benchmark box XXH3 hashed 1 MiB in ~17 us (cache
    hot) and 64 MiB at ~28 GiB/s, crc32 at ~4 GB/s, about the CPU cost of moving the bytes over
    loopback (experiments/connector_throughput.py prints both)."""
    return xxhash.xxh3_64_intdigest(memoryview(buffer).cast("B"))


def combine_checksums(checksums: Iterable[int]) -> int:
    """One checksum over a request's per-message checksums in send order (KVDone.checksum):
    a lost, repeated or reordered KVLayer changes it without reading the payload twice."""
    data = b"".join(int(c).to_bytes(8, "little") for c in checksums)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


# ---- buffers and tensors (torch imported lazily) ----

def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"KV dtype {dtype} cannot be sent: use one of {sorted(DTYPE_SIZES)}")
    return name


def tensor_from_frame(frame: Any, dtype: str, shape: Sequence[int]) -> Any:
    """A tensor viewing the frame's memory (no copy). Treat it as read-only, since it aliases the
    received frame: copy out of it (into KV blocks), never write into it."""
    import torch

    if dtype not in DTYPE_SIZES:
        raise ProtocolError(f"dtype {dtype!r} is not a KV dtype: expected one of {sorted(DTYPE_SIZES)}")
    torch_dtype = getattr(torch, dtype)
    if memoryview(frame).readonly:  # bytes; zmq frames are writable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable
            flat = torch.frombuffer(frame, dtype=torch_dtype)  # [nbytes / itemsize]
    else:
        flat = torch.frombuffer(frame, dtype=torch_dtype)
    return flat.view(tuple(shape))
