"""PDSERVE_KERNELS: the kernel backend an operator forces for every device (no torch here: `import pdserve.kernels`
checks it at once, without importing torch)."""

from __future__ import annotations

import os

ENV_VAR = "PDSERVE_KERNELS"
BACKENDS = ("torch", "triton")


def read_forced_backend(environ: dict | os._Environ = os.environ) -> str | None:
    """The backend PDSERVE_KERNELS forces, or None to choose by device."""
    value = environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_VAR}={environ[ENV_VAR]!r} is not a kernel backend: set it to 'torch' or 'triton', "
            f"or leave it unset to use Triton on CUDA tensors and torch elsewhere"
        )
    return value
