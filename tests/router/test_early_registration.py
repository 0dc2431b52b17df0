"""The router binds its registration address before it loads the tokenizer and names it on stderr
(PDSERVE_REGISTRATION), so `pdserve up` starts engines meanwhile; an engine that registers then is routed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from pdserve.local_cluster import EngineProcess
from tests.router.conftest import REPO, stop_process


def fields(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.split()[1:])


def test_registration_is_bound_and_named_before_ready_and_an_early_engine_is_routed(tiny_model, tmp_path):
    command = [sys.executable, "-m", "pdserve", "router", "--model", tiny_model, "--port", "0", "--insecure",
               "--registration-address", "tcp://127.0.0.1:0", "--log-level", "warning"]
    router = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    engine = None
    try:
        early = next(line for line in router.stderr if line.startswith("PDSERVE_REGISTRATION "))
        address = fields(early)["registration"]
        assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
        # the engine starts while the router still loads its tokenizer
        engine = EngineProcess("decode", tiny_model, "--router-address", address, "--num-kv-blocks", "64",
                               log_dir=tmp_path)
        ready = fields(router.stdout.readline())
        assert ready["registration"] == address, "stdout's first line is still READY, with the same address"
        deadline = time.monotonic() + 30
        while httpx.get(f"{ready['url']}/health").json()["engines"] != {"prefill": 0, "decode": 1}:
            assert time.monotonic() < deadline, "the engine that registered early was never routed"
            time.sleep(0.05)
    finally:
        if engine is not None:
            engine.stop()
        stop_process(router, timeout=30)
