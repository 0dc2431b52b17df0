"""An engine a router refuses says so and exits non-zero (issue 49 item 4): one with the wrong keys printed
PDSERVE_READY and never learned it was not admitted. Real `pdserve up`, real engine processes; and the
watch itself against real CURVE sockets."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from pdserve.control.errors import TransportTimeout
from pdserve.control.admission import EXIT_NOT_ADMITTED, AdmissionWatch, NotAdmitted
from pdserve.control.keys import load_cluster_keys, write_cluster_keys
from pdserve.control.messages import Deregister
from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.local_cluster import EngineProcess
from tests.router.conftest import ENGINE_ARGS, UpProcess

REFUSAL_BOUND_S = 20.0


@pytest.mark.hostile
def test_engines_with_other_keys_say_they_were_refused_and_exit_non_zero(tiny_model, tmp_path):
    up = UpProcess(tiny_model, tmp_path / "up", "--num-prefill", "0", "--num-decode", "1")
    rogues = []
    try:
        registration = up.ready_line("router")["registration"]
        own_keys = write_cluster_keys(tmp_path / "own-keys")
        for engine_id, trust in (("plaintext", ()), ("own-keys", ("--curve-dir", str(own_keys)))):
            rogues.append(EngineProcess("prefill", tiny_model, *ENGINE_ARGS, "--router-address", registration,
                                        "--engine-id", engine_id, *trust, log_dir=tmp_path))
            ready_at = time.monotonic()
            code = rogues[-1].process.wait(timeout=REFUSAL_BOUND_S + 30)
            took = time.monotonic() - ready_at
            log = rogues[-1].log()
            assert code == EXIT_NOT_ADMITTED, log[-2000:]
            assert f"the router at {registration} refused this engine" in log and "--curve-dir DIR" in log, log
            assert took < REFUSAL_BOUND_S, took
        with urllib.request.urlopen(f"{up.url}/health", timeout=5) as answer:
            assert json.loads(answer.read())["engines"] == {"prefill": 0, "decode": 1}  # up's own, serving on
    finally:
        for rogue in rogues:
            rogue.stop()
        up.stop()


def watch_against(server_keys, client_curve, timeout_s: float, watch_after_s: float = 0.0
                  ) -> tuple[AdmissionWatch, ClientSocket, ServerSocket]:
    server = ServerSocket("tcp://127.0.0.1:0", curve=server_keys)
    client = ClientSocket(server.address, curve=client_curve)
    time.sleep(watch_after_s)  # the first handshake may be over before the watch exists
    watch = AdmissionWatch(server.address, client.socket, "tcp://10.9.8.7:5600", timeout_s=timeout_s)
    try:
        client.send(Deregister(engine_id="e", control_address="tcp://10.9.8.7:5600"), timeout=1.0)
    except TransportTimeout:
        pass  # a refused connection takes nothing (the DEALER queues only on a connection that completed)
    return watch, client, server


def checked_until_refused(watch: AdmissionWatch, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        watch._checked = 0.0  # every call reads the events (the engine loop checks twice a second)
        try:
            watch.check()
        except NotAdmitted as refusal:
            return str(refusal)
        time.sleep(0.05)
    return None


def test_a_router_that_takes_the_handshake_but_never_reaches_the_engine_is_a_refusal_after_the_timeout(tmp_path):
    keys = load_cluster_keys(write_cluster_keys(tmp_path / "keys"))
    watch, client, server = watch_against(keys.server, keys.client, timeout_s=0.5)
    try:
        refusal = checked_until_refused(watch, 5.0)
        assert refusal is not None and "did not reach it at tcp://10.9.8.7:5600 within 0.5s" in refusal, refusal
        admitted, client2, server2 = watch_against(keys.server, keys.client, timeout_s=0.5)
        admitted.admitted = True  # a router reached the engine: never a refusal
        try:
            assert checked_until_refused(admitted, 1.5) is None
        finally:
            admitted.close(), client2.close(), server2.close()
    finally:
        watch.close(), client.close(), server.close()


def test_a_router_not_listening_yet_is_waited_for(tmp_path):
    keys = load_cluster_keys(write_cluster_keys(tmp_path / "keys"))
    client = ClientSocket("tcp://127.0.0.1:9", curve=keys.client)  # nothing listens: not a refusal
    watch = AdmissionWatch("tcp://127.0.0.1:9", client.socket, "tcp://10.9.8.7:5600", timeout_s=0.2)
    try:
        assert checked_until_refused(watch, 1.5) is None
    finally:
        watch.close(), client.close()


@pytest.mark.parametrize("watch_after_s", [0.0, 0.3])
def test_a_plaintext_engine_against_a_curve_router_is_refused_after_its_one_handshake(tmp_path, watch_after_s):
    """ZeroMQ never retries a handshake that failed on the mechanism (NULL against CURVE): that one failure is
    the refusal, seen even when it happened before the watch was made."""
    keys = load_cluster_keys(write_cluster_keys(tmp_path / "keys"))
    watch, client, server = watch_against(keys.server, None, timeout_s=30.0, watch_after_s=watch_after_s)
    try:
        refusal = checked_until_refused(watch, 3.0)
        assert refusal is not None and re.search(r"\d+ connection handshakes? failed", refusal), refusal
        assert "no CURVE keys (--insecure)" not in refusal  # the watch was told the engine is secured
    finally:
        watch.close(), client.close(), server.close()
