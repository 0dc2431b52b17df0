"""Run the Triton kernels under the Triton interpreter (CPU tensors, no GPU needed).

Triton decides between compiling and interpreting when a kernel module is imported, so the variable
is set here, at conftest import, before any test module of this folder imports a kernel module.
If an earlier test folder already imported kernel modules compiled for the GPU, they are reloaded.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"


def _reload_kernel_modules_for_the_interpreter() -> None:
    utils = sys.modules.get("kernels.triton_utils")
    if utils is None or utils.INTERPRET:
        return
    importlib.reload(utils)
    for name in ["kernels.checks"] + sorted(n for n in sys.modules if n.startswith("kernels.triton_")):
        if name in sys.modules and name != "kernels.triton_utils":
            importlib.reload(sys.modules[name])
    dispatch = sys.modules.get("kernels.dispatch")
    if dispatch is not None:
        dispatch.triton_kernel.cache_clear()


_reload_kernel_modules_for_the_interpreter()
