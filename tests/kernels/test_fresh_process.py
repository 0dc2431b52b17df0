"""Where the kernel tests cannot run under the interpreter in this process (a CUDA machine, or triton
imported before tests/kernels/conftest.py), run them in a new process that interprets."""

from __future__ import annotations

import pytest

from tests.kernels import conftest
from tests.kernels.subprocess_env import run_python


@pytest.mark.skipif(not conftest.RUN_IN_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_kernel_tests_in_a_fresh_process():
    result = run_python(
        "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels']))",
        timeout=900,
        TRITON_INTERPRET="1",
        **{conftest.CHILD_VARIABLE: "1"},
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
