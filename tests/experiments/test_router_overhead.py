"""The router-overhead benchmark runs end to end at toy sizes (its synthetic engine speaks the current
control protocol), so a protocol change cannot break it unseen."""

from __future__ import annotations

import subprocess
import sys

from tests.router.conftest import REPO

SCRIPT = str(REPO / "experiments" / "router_overhead.py")


def run_bench(*args: str) -> str:
    result = subprocess.run([sys.executable, SCRIPT, "--warmup", "1", *args],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=None)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_router_overhead_runs_at_toy_sizes():
    out = run_bench(  # the script's own default model (a tiny demo model it builds); the others get the tests' copy
        "--num-requests", "3", "--streams", "2", "--stream-tokens", "16")
    assert "| end to end |" in out and "| 2 | 0 | 32 |" in out, out


def test_router_overhead_against_the_bare_relay(model_factory):
    out = run_bench("--model", model_factory("llama"), "--num-requests", "2", "--router", "bare")
    assert "front end: bare" in out and "| first token |" in out, out
    assert "relay throughput" not in out  # the bare relay has no usage chunk to count


def test_router_overhead_measures_a_baseline_router_in_the_same_rounds_with_the_httpx_client(model_factory):
    """--baseline-python: a second router (here the same interpreter's pdserve), and --with-floor: the bare
    relay, in the same rounds; each one's overhead and its per-round difference to the router reported; all
    measured through the httpx client (--client httpx)."""
    out = run_bench("--model", model_factory("llama"), "--num-requests", "2", "--skip-relay", "--client", "httpx",
                    "--baseline-python", sys.executable, "--with-floor")
    assert "HTTP client: httpx" in out and "| first token |" in out, out
    for title in ("baseline: the router of", "floor: the bare relay"):
        table = out.split(title, 1)[1]
        assert "| first token |" in table and "| end to end |" in table and "CPU time per request" in table, out


def test_router_overhead_names_a_baseline_python_that_is_not_there():
    result = subprocess.run([sys.executable, SCRIPT, "--baseline-python",
                             "/nonexistent/python"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "is not an executable python" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
