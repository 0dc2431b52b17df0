"""Run a Python snippet in a fresh interpreter at the repository root, with a chosen environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: float = 180, **env_changes: str) -> subprocess.CompletedProcess:
    """Run `code` with PDSERVE_KERNELS and TRITON_INTERPRET cleared, then `env_changes` applied."""
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_KERNELS", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.update(env_changes)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_ok(code: str, **env_changes: str) -> str:
    """run_python, failing the test with the child's output unless it exits 0; returns its stdout."""
    result = run_python(code, **env_changes)
    assert result.returncode == 0, f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout
