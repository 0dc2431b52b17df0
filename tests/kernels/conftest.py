"""Run the Triton kernel tests under the Triton interpreter (CPU tensors, no GPU needed), without
leaving the interpreter on for the rest of the suite where a GPU should run compiled kernels.

Triton chooses between compiling and interpreting when it (and each kernel module) is imported. So:
  * on a machine without CUDA, TRITON_INTERPRET=1 is set here for the process (tests/conftest.py
    already set it before any import, so the whole suite interprets, as it must without a GPU);
  * on a CUDA machine, nothing is set here: the CUDA engine tests of this process run compiled
    kernels, and the tests of this folder run in a fresh interpreter-mode process instead
    (test_fresh_process.py), as they also do when triton was imported before this conftest.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

CHILD_VARIABLE = "PDSERVE_KERNEL_TESTS_CHILD"  # set in the fresh process: run the tests right there
IN_CHILD = os.environ.get(CHILD_VARIABLE) == "1"
TRITON_IMPORTED_BEFORE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
RUN_IN_FRESH_PROCESS = not IN_CHILD and (torch.cuda.is_available() or TRITON_IMPORTED_BEFORE)
if not RUN_IN_FRESH_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"

FRESH_PROCESS_TEST = "test_kernel_tests_in_a_fresh_process"
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    if not RUN_IN_FRESH_PROCESS:
        return
    why = ("a CUDA device is present, so this process keeps compiled triton" if torch.cuda.is_available()
           else "triton was imported for the GPU before tests/kernels/conftest.py could set TRITON_INTERPRET=1")
    skip = pytest.mark.skip(reason=f"{why}: these tests run in a fresh process ({FRESH_PROCESS_TEST})")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents and item.name != FRESH_PROCESS_TEST:
            item.add_marker(skip)
