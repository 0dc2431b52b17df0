"""Issue #49's probe under `pdserve up` (CURVE on, pinned engine ports): kill -9 of prefill-0, which the
supervisor restarts on the same control and KV addresses. Before, every disaggregated request after that took
30.6 s (the decode engine's link to the old process said `no_hello` to each KVWant, ignored, and the KV timeout
ended each); now the decode engine says Hello to the new process at once and the requests take what they did."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import threading
import time

import httpx
import pytest

from tests.router.conftest import UpProcess, wait_no_kv_used
from tests.router.test_supervision import _read_lines, latest_pid, wait_for_line

pytestmark = pytest.mark.hostile

NUM_REQUESTS = 20
RESTART_BOUND_S = 90.0  # restart + model load on a busy 2-core machine
PROMPTS = [f"def handler_{i}(request):\n    return" for i in range(NUM_REQUESTS)]


def free_port_base(count: int) -> int:
    """A port p with p .. p + count - 1 all free on loopback now."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65536 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def one_by_one(url: str, model: str) -> tuple[list[str], list[float]]:
    """Each prompt alone: its greedy text and its end-to-end seconds."""
    texts, seconds = [], []
    for prompt in PROMPTS:
        started = time.monotonic()
        answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        seconds.append(time.monotonic() - started)
        assert answer.status_code == 200, answer.text
        texts.append(answer.json()["choices"][0]["text"])
    return texts, seconds


def test_a_prefill_engine_killed_under_up_is_trusted_again_at_once(model_factory, tmp_path):
    base = free_port_base(6)  # the engines' 4 ports, then the router's HTTP port and registration address
    up = UpProcess(model_factory("llama"), tmp_path / "logs", "--num-prefill", "1", "--num-decode", "1",
                   "--engine-port-base", str(base), "--port", str(base + 4),
                   "--registration-address", f"tcp://127.0.0.1:{base + 5}", "--heartbeat-timeout", "2")
    threading.Thread(target=_read_lines, args=(up,), daemon=True).start()
    try:
        model = httpx.get(f"{up.url}/v1/models").json()["data"][0]["id"]
        one_by_one(up.url, model)  # warm
        expected, unloaded = one_by_one(up.url, model)

        pid = latest_pid(up, "prefill-0")
        os.kill(pid, signal.SIGKILL)
        wait_for_line(up, "prefill-0 ready", RESTART_BOUND_S, also="; restart 1)")
        deadline = time.monotonic() + 30
        while httpx.get(f"{up.url}/health").json()["engines"] != {"prefill": 1, "decode": 1}:
            assert time.monotonic() < deadline, "the restarted prefill engine never joined routing"
            time.sleep(0.1)
        texts, after = one_by_one(up.url, model)

        print(f"\nunder up, after kill -9 of prefill-0 and its restart: the next {NUM_REQUESTS} requests median "
              f"{statistics.median(after):.3f}s, max {max(after):.3f}s; unloaded before: median "
              f"{statistics.median(unloaded):.3f}s, max {max(unloaded):.3f}s")
        decode_log = (up.log_dir / "decode-0.log").read_text()
        assert "no complete KV" not in decode_log and "did not compute the prompt" not in decode_log
        assert max(after) < 10, f"a request after the restart took {max(after):.1f}s (the KV timeout is 30 s)"
        assert statistics.median(after) < 2 * statistics.median(unloaded)
        assert texts == expected, "greedy output changed"
        used = wait_no_kv_used(up.url, timeout=30)
        assert used and all(value == 0 for value in used.values()), used
    finally:
        assert up.stop() == 0, "".join(up.lines) + up.logs()
