"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

Fused projections (QKV, gate/up) hold one weight; each checkpoint shard is copied into its rows
through `weight_loader(param, tensor, shard_id)`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# On CPU, fp32 products with a handful of rows (batch-1 decode) are weight-bandwidth bound, and
# numpy's bundled OpenBLAS streams the weights faster than torch's own GEMM here (docs/BENCHMARKS.md,
# "small-batch linear"); larger batches stay on torch. OpenBLAS runs single-threaded: its spinning
# threads and torch's OpenMP threads would otherwise fight over the same cores.
NUMPY_MAX_ROWS = 4


def _single_threaded_openblas() -> None:
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # numpy's OpenBLAS only; torch keeps its own threads


_single_threaded_openblas()


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not match the model's parameter."""


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise WeightShapeError(
            f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, the model expects {tuple(target.shape)}: "
            "the weights do not belong to this config.json"
        )
    with torch.no_grad():
        target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, name: str = "") -> None:
    copy_checked(param.data, loaded, name)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight.weight_loader = default_weight_loader
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if x.shape[0] <= NUMPY_MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
            out = torch.from_numpy(np.matmul(x.numpy(), self.weight.numpy().T))
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked by output rows, e.g. q|k|v or gate|up.

    shard_sizes maps each shard id ("q", "k", "v" or 0, 1) to its number of output rows, in order.
    """

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object, name: str = "") -> None:
        offset, size = self.shard_offsets[shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded, name)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        # [T, sum(sizes)] -> one [T, size] view per shard, in declaration order
        return list(out.split([size for _, size in self.shard_offsets.values()], dim=-1))
