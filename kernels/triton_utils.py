"""What every Triton kernel module shares: the interpreter flag and small launch-time helpers.

Importing this module imports triton; only the Triton kernel modules import it, so the CPU engine
(torch backend) never pays for it.
"""

from __future__ import annotations

import os

import torch
import triton


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Read once: triton decides at decoration time (when a kernel module is imported) whether a kernel
# is compiled for the GPU or run by the Python interpreter, so this flag matches the kernels below.
INTERPRET = _interpreting()

# log2(e): the kernels take exp2 of scores pre-multiplied by scale * LOG2E.
LOG2E = 1.4426950408889634


def next_pow2(value: int) -> int:
    return triton.next_power_of_2(max(1, int(value)))


def cdiv(numerator: int, denominator: int) -> int:
    return (numerator + denominator - 1) // denominator


def upcast_for_dot(dtype: torch.dtype) -> bool:
    """Whether a kernel must turn its tiles into fp32 before tl.dot.

    On the GPU tl.dot takes fp16/bf16 tiles directly (tensor cores). The interpreter keeps bf16 as raw
    uint16 bits and computes garbage with them, so under TRITON_INTERPRET bf16 tiles go through fp32.
    (The interpreter also truncates fp32 -> bf16 casts where the GPU rounds to nearest: bf16 results
    there can be 1 ulp off; the tests' bf16 tolerance covers it.)
    """
    return INTERPRET and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products ("ieee"), not TF32, so fp32 results match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """Keyword arguments for a kernel launch, leaving Triton's defaults where None is given."""
    options = {}
    if num_warps is not None:
        options["num_warps"] = num_warps
    if num_stages is not None:
        options["num_stages"] = num_stages
    return options
