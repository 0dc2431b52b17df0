"""Run the Triton kernels under the Triton interpreter (CPU tensors, no GPU needed).

Triton chooses between compiling and interpreting when it (and each kernel module) is imported, so
TRITON_INTERPRET=1 is set here, when pytest loads this conftest. That is too late when a test module
collected earlier already imported triton (torch._dynamo does, e.g. through transformers' models):
then the tests of this folder are skipped in this process and test_fresh_process.py runs the whole
folder again in a new interpreter, where the variable comes first.
"""

import os
import sys
from pathlib import Path

import pytest

TRITON_IMPORTED_BEFORE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
os.environ["TRITON_INTERPRET"] = "1"

FRESH_PROCESS_TEST = "test_kernel_tests_in_a_fresh_process"
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    if not TRITON_IMPORTED_BEFORE:
        return
    skip = pytest.mark.skip(
        reason="triton was imported for the GPU before tests/kernels/conftest.py set TRITON_INTERPRET=1: "
        f"these tests run in a fresh process ({FRESH_PROCESS_TEST})"
    )
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents and item.name != FRESH_PROCESS_TEST:
            item.add_marker(skip)
