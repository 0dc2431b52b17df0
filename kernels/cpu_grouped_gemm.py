"""The mixture-of-experts grouped GEMM on pdserve's bfloat16 CPU kernel (kernels/cpu_gemm.py): every expert's
weight packed once into the kernel's panels, then each expert's rows multiplied by its own panels in one call.
Rows, groups and result as kernels/reference_moe.grouped_gemm, with the weights given packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import cpu_gemm


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's [N, K] weight in cpu_gemm.pack_weight's layout, one expert per row of `panels`."""

    panels: torch.Tensor  # [E, P] bfloat16
    out_features: int  # N
    in_features: int  # K


def supports(weights: torch.Tensor) -> bool:  # [E, N, K]
    """Whether these stacked expert weights run on the kernel: bfloat16 on a CPU that has it, K even."""
    return weights.dim() == 3 and weights.shape[0] > 0 and cpu_gemm.supports(weights[0], None)


def pack_experts(weights: torch.Tensor) -> PackedExperts:  # [E, N, K] bfloat16
    """Pack one expert at a time, so packing holds at most the stacked weights plus their packed copy."""
    num_experts, out_features, in_features = weights.shape
    first = cpu_gemm.pack_weight(weights[0])
    panels = first.new_empty(num_experts, first.numel())  # [E, P]
    panels[0] = first
    for expert in range(1, num_experts):
        panels[expert] = cpu_gemm.pack_weight(weights[expert])
    return PackedExperts(panels, out_features, in_features)


def grouped_gemm(
    a: torch.Tensor,  # [M, K] bfloat16, rows sorted by expert
    b: PackedExperts,  # E experts' [N, K] weights, packed
    group_ends: torch.Tensor,  # [E] int, cumulative row counts: expert e ends at row group_ends[e]
) -> torch.Tensor:  # [M, N] bfloat16: row i times the weight of the expert that owns it
    """One kernel call per expert that owns rows, writing straight into its rows of the result."""
    if a.dtype != torch.bfloat16 or a.shape[-1] != b.in_features:
        raise TypeError(f"packed bf16 experts of {b.in_features} inputs got a {a.dtype} input of "
                        f"{a.shape[-1]}: pass the model's bfloat16 activations")
    a = a.contiguous()
    out = a.new_empty(a.shape[0], b.out_features)
    kernel, threads = cpu_gemm.packed_gemm(), torch.get_num_threads()
    start = 0
    for expert, end in enumerate(group_ends.tolist()):  # a host read: the groups' sizes set the calls
        if end > start:
            kernel(a[start].data_ptr(), b.panels[expert].data_ptr(), None, out[start].data_ptr(),
                   end - start, b.in_features, b.out_features, threads)
        start = end
    return out
