"""The router-overhead benchmark runs end to end at toy sizes (its synthetic engine speaks the current
control protocol), so a protocol change cannot break it unseen."""

from __future__ import annotations

import subprocess
import sys

from tests.router.conftest import REPO


def test_router_overhead_runs_at_toy_sizes(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.router_overhead", "--num-requests", "3", "--warmup", "1",
         "--streams", "2", "--stream-tokens", "16"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| end to end |" in result.stdout and "| 2 | 0 | 32 |" in result.stdout, result.stdout


def test_router_overhead_with_the_httpx_client(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.router_overhead", "--num-requests", "2", "--warmup", "1",
         "--skip-relay", "--client", "httpx"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HTTP client: httpx" in result.stdout and "| first token |" in result.stdout, result.stdout


def test_router_overhead_against_the_bare_relay(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.router_overhead", "--num-requests", "2", "--warmup", "1",
         "--router", "bare"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "front end: bare" in result.stdout and "| first token |" in result.stdout, result.stdout
    assert "relay throughput" not in result.stdout  # the bare relay has no usage chunk to count
