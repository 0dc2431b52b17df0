"""Planes are authenticated by default: `pdserve up` runs on cluster keys it makes once, an engine without
them cannot join, and plaintext takes an explicit --insecure that loopback alone allows."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pdserve.local_cluster import EngineProcess
from pdserve.router.config import RouterConfig
from pdserve.router.server import warn_if_open
from pdserve.trust import curve_dir_for, default_cluster_keys, is_loopback
from tests.decode.test_disaggregated import start_together, stop_together
from tests.router.conftest import ENGINE_ARGS, REPO, UpProcess
from tests.router.test_launcher_and_compose import up_args


@pytest.mark.parametrize("address,loopback", [
    ("tcp://127.0.0.1:5600", True), ("tcp://127.9.9.9:1", True), ("tcp://[::1]:5600", True),
    ("tcp://localhost:7000", True), ("ipc:///tmp/pdserve.sock", True), ("tcp://0.0.0.0:5600", False),
    ("tcp://*:5600", False), ("tcp://10.0.0.3:5600", False), ("tcp://router:7000", False),
])
def test_loopback_addresses(address, loopback):
    assert is_loopback(address) is loopback


@pytest.mark.parametrize("host,api_key,warns", [
    ("0.0.0.0", None, True), ("::", None, True), ("10.0.0.3", None, True), ("127.0.0.1", None, False),
    ("localhost", None, False), ("[::1]", None, False), ("0.0.0.0", "k3y", False),
])
def test_router_warns_when_it_serves_beyond_loopback_without_a_key(caplog, host, api_key, warns):
    config = RouterConfig(model="unused", served_model_name="m", host=host, api_key=api_key)
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        warn_if_open(config, port=8123)
    expected = [f"no API key and HTTP on {host}: any client that reaches port 8123 can use the model; set "
                "--api-key or PDSERVE_API_KEY (or --host 127.0.0.1)"] if warns else []
    assert [record.getMessage() for record in caplog.records] == expected


def _trust(curve_dir=None, insecure=False) -> argparse.Namespace:
    return argparse.Namespace(curve_dir=curve_dir, insecure=insecure)


def test_plaintext_takes_insecure_and_loopback():
    with pytest.raises(ValueError, match=r"pass --curve-dir DIR .*pdserve keygen DIR.* or --insecure"):
        curve_dir_for(_trust(), ["tcp://127.0.0.1:5600"])
    with pytest.raises(ValueError, match="--insecure would speak plaintext on tcp://0.0.0.0:5600"):
        curve_dir_for(_trust(insecure=True), ["tcp://0.0.0.0:5600", None])
    with pytest.raises(ValueError, match="contradict"):
        curve_dir_for(_trust("/keys", insecure=True), [])
    assert curve_dir_for(_trust(insecure=True), ["tcp://127.0.0.1:0", "ipc:///tmp/x"]) is None
    assert curve_dir_for(_trust("/keys"), ["tcp://0.0.0.0:5600"]) == "/keys"


def test_an_engine_refuses_to_start_in_plaintext_beyond_loopback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pdserve", "decode", "--model", str(tmp_path),
                             "--control-address", "tcp://0.0.0.0:0", "--insecure"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "pdserve decode: error: --insecure would speak plaintext on tcp://0.0.0.0:0" in result.stderr


def test_up_gives_every_component_the_cluster_keys_unless_insecure():
    from pdserve.up import engine_components, resolve_keys, router_component

    args = up_args()
    resolve_keys(args)
    assert args.curve_dir == str(default_cluster_keys())
    commands = [router_component(args, "m", "m").command,
                *(engine.command for engine in engine_components(args, "m", "tcp://127.0.0.1:7000"))]
    assert all(command[command.index("--curve-dir") + 1] == args.curve_dir for command in commands)
    args = up_args("--insecure")
    resolve_keys(args)
    assert all("--insecure" in engine.command for engine in engine_components(args, "m", "tcp://127.0.0.1:7000"))


def _decode_engines(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return json.loads(response.read())["engines"]["decode"]
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())["engines"]["decode"]


def test_an_engine_without_the_cluster_keys_cannot_join(tiny_model, tmp_path):
    up = UpProcess(tiny_model, tmp_path / "up", "--num-prefill", "0", "--num-decode", "1")
    try:
        assert any("CURVE keys in" in line for line in up.lines), "up runs on keys by default"
        registration = up.ready_line("router")["registration"]
        rogue, member = start_together(
            lambda: EngineProcess("decode", tiny_model, *ENGINE_ARGS, "--router-address", registration,
                                  "--engine-id", "rogue", log_dir=tmp_path),  # plaintext: --insecure
            lambda: EngineProcess("decode", tiny_model, *ENGINE_ARGS, "--router-address", registration,
                                  "--engine-id", "member", "--curve-dir", str(default_cluster_keys()),
                                  log_dir=tmp_path))
        try:
            deadline = time.monotonic() + 20
            while _decode_engines(up.url) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(3.0)  # three heartbeats more for the rogue to get in, if it could
            assert _decode_engines(up.url) == 2, "up's own decode engine and the member: never the rogue"
        finally:
            stop_together(rogue, member)
    finally:
        up.stop()


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free loopback ports."""
    import socket

    for base in range(41000, 60000, 97):
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


def test_up_binds_the_ports_it_is_given(tiny_model, tmp_path):
    """For firewalls and containers: the HTTP port, the registration address and every engine's ports are pinned
    (the HTTP port too, so no port the OS picks can land inside the run)."""
    base = free_port_run(6)
    registration = f"tcp://127.0.0.1:{base + 4}"
    up = UpProcess(tiny_model, tmp_path / "up", "--num-prefill", "1", "--num-decode", "1", "--port", str(base + 5),
                   "--registration-address", registration, "--engine-port-base", str(base))
    try:
        assert up.url == f"http://127.0.0.1:{base + 5}"
        assert up.ready_line("router")["registration"] == registration
        assert up.ready_line("prefill-0")["control"] == f"tcp://127.0.0.1:{base}"
        assert up.ready_line("prefill-0")["kv"] == f"tcp://127.0.0.1:{base + 1}"
        assert up.ready_line("decode-0")["control"] == f"tcp://127.0.0.1:{base + 2}"
        body = json.dumps({"model": tiny_model, "prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(f"{up.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 2
    finally:
        assert up.stop() == 0, up.logs()
