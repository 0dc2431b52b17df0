"""Pick the Triton or the torch implementation of each kernel.

Default: per call, by the device of the first tensor argument: CUDA -> Triton, anything else ->
torch (kernels.reference / kernels.reference_extra). PDSERVE_KERNELS=torch|triton, read once at
import, forces one backend for every device (`PDSERVE_KERNELS=triton TRITON_INTERPRET=1` runs the
Triton kernels on CPU tensors). Triton modules are imported on first use, so a CPU process on the
torch backend never imports triton.

Cost per call: with PDSERVE_KERNELS=torch, or on a torch build without CUDA, the exported names ARE
the reference functions (no wrapper at all); otherwise one Python call plus a device check.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable

import torch

from pdserve.kernels import reference, reference_extra, reference_moe
from pdserve.kernels.forced_backend import read_forced_backend


# kernel name -> (torch implementation, module holding the Triton implementation of the same name)
KERNELS: dict[str, tuple[Callable, str]] = {
    "store_kv": (reference.store_kv, "pdserve.kernels.triton_store_kv"),
    "paged_decode_attention": (reference.paged_decode_attention, "pdserve.kernels.triton_decode_attention"),
    "paged_prefill_attention": (reference.paged_prefill_attention, "pdserve.kernels.triton_prefill_attention"),
    "kv_pack": (reference.kv_pack, "pdserve.kernels.triton_kv_transfer"),
    "kv_unpack": (reference.kv_unpack, "pdserve.kernels.triton_kv_transfer"),
    "add_rms_norm": (reference_extra.add_rms_norm, "pdserve.kernels.triton_norm"),
    "rotary_embedding": (reference_extra.rotary_embedding, "pdserve.kernels.triton_rotary"),
    "grouped_gemm": (reference_moe.grouped_gemm, "pdserve.kernels.triton_grouped_gemm"),
}


FORCED_BACKEND = read_forced_backend()


def kernel_backend(device: torch.device | str) -> str:
    """'triton' or 'torch': which implementation the kernels use for tensors on `device`."""
    if FORCED_BACKEND is not None:
        return FORCED_BACKEND
    return "triton" if torch.device(device).type == "cuda" else "torch"


@functools.cache
def triton_kernel(name: str) -> Callable:
    """The Triton implementation of kernel `name` (imports its module, and triton, on first use)."""
    return getattr(importlib.import_module(KERNELS[name][1]), name)


def kernel_for(name: str, device: torch.device | str) -> Callable:
    """The implementation of kernel `name` for tensors on `device`: for callers that choose once (the KV
    transfer path picks its kernels when it binds the cache) instead of dispatching on every call."""
    return triton_kernel(name) if kernel_backend(device) == "triton" else KERNELS[name][0]


def _cuda_possible() -> bool:
    # Compile-time facts only: torch.cuda.is_available() would initialize the driver at import.
    return torch.backends.cuda.is_built() or torch.version.hip is not None


def _forced_triton(name: str, reference_fn: Callable) -> Callable:
    @functools.wraps(reference_fn)
    def call(*args, **kwargs):
        return triton_kernel(name)(*args, **kwargs)

    return call


def _by_device(name: str, reference_fn: Callable) -> Callable:
    first = next(iter(inspect.signature(reference_fn).parameters))  # the tensor that decides

    @functools.wraps(reference_fn)
    def call(*args, **kwargs):
        tensor = args[0] if args else kwargs[first]
        if tensor.is_cuda:
            return triton_kernel(name)(*args, **kwargs)
        return reference_fn(*args, **kwargs)

    return call


def build(name: str) -> Callable:
    """The function exported as kernels.<name>, following FORCED_BACKEND."""
    reference_fn = KERNELS[name][0]
    if FORCED_BACKEND == "torch" or (FORCED_BACKEND is None and not _cuda_possible()):
        return reference_fn
    if FORCED_BACKEND == "triton":
        return _forced_triton(name, reference_fn)
    return _by_device(name, reference_fn)
