"""When triton was imported before this folder's conftest, run the kernel tests in a new process."""

from __future__ import annotations

import pytest

from tests.kernels import conftest
from tests.kernels.subprocess_env import run_python


@pytest.mark.skipif(not conftest.TRITON_IMPORTED_BEFORE, reason="the kernel tests run in this process")
def test_kernel_tests_in_a_fresh_process():
    result = run_python(
        "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels']))",
        timeout=900,
        TRITON_INTERPRET="1",
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
