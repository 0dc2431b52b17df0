"""Every Triton kernel compiles for an sm_90 GPU (checked here without one; see compile_sm90.py)."""

from __future__ import annotations

from tests.kernels.subprocess_env import run_python


def test_kernels_compile_to_sm90_cubins():
    # A fresh process without TRITON_INTERPRET, so triton.jit builds real GPU kernels.
    result = run_python("import sys, runpy; sys.argv = ['compile_sm90', '--quick']; "
                        "runpy.run_module('tests.kernels.compile_sm90', run_name='__main__')", timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 kernel(s) failed to compile for sm_90" in result.stdout
    assert result.stdout.count("ok   ") >= 10
