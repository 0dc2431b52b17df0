"""Pick a model runner's attention backend once, from its device and PDSERVE_KERNELS."""

from __future__ import annotations

import importlib.util

import torch

from pdserve import kernels
from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.torch_paged import TorchPagedBackend
from pdserve.engine.config import ConfigError


def get_attn_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """Triton on CUDA, torch-paged elsewhere; PDSERVE_KERNELS=torch|triton forces one (kernels.kernel_backend)."""
    if kernels.kernel_backend(device) == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(f"the Triton kernels (chosen for {device}) need triton, which is not installed: "
                              "pip install 'pdserve[triton]' (torch's CUDA wheels on Linux bring it), or set "
                              "PDSERVE_KERNELS=torch")
        from pdserve.engine.attention.triton import TritonBackend  # imports triton: only when chosen

        return TritonBackend()
    return TorchPagedBackend(block_size)
