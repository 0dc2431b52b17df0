"""Pick a model runner's attention backend once, from its device and PDSERVE_KERNELS."""

from __future__ import annotations

import torch

from pdserve import kernels
from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.torch_paged import TorchPagedBackend


def get_attn_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """Triton on CUDA, torch-paged elsewhere; PDSERVE_KERNELS=torch|triton forces one (kernels.kernel_backend)."""
    if kernels.kernel_backend(device) == "triton":
        from pdserve.engine.attention.triton import TritonBackend  # imports triton: only when chosen

        return TritonBackend()
    return TorchPagedBackend(block_size)
