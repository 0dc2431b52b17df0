"""The engine side of registration: the new control messages on the wire, the advertised address of
a wildcard bind, and the Heartbeat thread against a real socket (Register + stats, then Deregister)."""

from __future__ import annotations

import socket
import time

import pytest

from pdserve.control.errors import ProtocolError
from pdserve.control.heartbeat import Heartbeat, advertised_address
from pdserve.control.messages import Deregister, DescribeRequest, EngineStats, Register
from pdserve.control.protocol import decode, encode
from pdserve.control.sockets import ServerSocket

REGISTER = Register(engine_id="prefill-0", role="prefill", control_address="tcp://10.0.0.3:5600",
                    kv_address="tcp://10.0.0.3:5700", block_size=16, max_model_len=4096, vocab_size=32000,
                    heartbeat_interval_s=0.05)
STATS = EngineStats(engine_id="prefill-0", role="prefill", num_waiting=0, num_running=1, kv_blocks_used=3,
                    kv_blocks_total=64, queued_prefill_tokens=12)


@pytest.mark.parametrize("msg", [DescribeRequest(), REGISTER, Deregister(engine_id="d", control_address="ipc:///x")])
def test_registration_messages_round_trip(msg):
    decoded, frames = decode([bytes(part) for part in encode(msg)])
    assert decoded == msg and not frames


def test_register_is_validated():
    with pytest.raises(ProtocolError, match="role"):
        Register(engine_id="x", role="router", control_address="tcp://a:1", block_size=16, max_model_len=8,
                 vocab_size=8)
    with pytest.raises(ProtocolError, match="bind-any address.*--advertise-address"):
        Register(engine_id="x", role="prefill", control_address="tcp://0.0.0.0:5600", block_size=16,
                 max_model_len=8, vocab_size=8)
    with pytest.raises(ProtocolError, match="bind-any"):
        Register(engine_id="x", role="prefill", control_address="tcp://10.0.0.3:5600", kv_address="tcp://*:5700",
                 block_size=16, max_model_len=8, vocab_size=8)
    with pytest.raises(ProtocolError, match="block_size"):
        Register(engine_id="x", role="decode", control_address="tcp://a:1", block_size=0, max_model_len=8,
                 vocab_size=8)


def test_wildcard_binds_advertise_a_reachable_host():
    assert advertised_address("tcp://0.0.0.0:5600", "prefill-1") == "tcp://prefill-1:5600"
    assert advertised_address("tcp://0.0.0.0:5600") == f"tcp://{socket.gethostbyname(socket.gethostname())}:5600"
    assert advertised_address("tcp://127.0.0.1:5600") == "tcp://127.0.0.1:5600"
    assert advertised_address("ipc:///tmp/engine.sock") == "ipc:///tmp/engine.sock"


def test_a_wildcard_bind_advertises_the_ip_on_the_route_to_the_router():
    # the kernel's source address toward the router: loopback for a router on loopback
    assert advertised_address("tcp://0.0.0.0:5600", toward="tcp://127.0.0.1:7000") == "tcp://127.0.0.1:5600"
    assert advertised_address("tcp://0.0.0.0:5600", "10.1.2.3", toward="tcp://127.0.0.1:7000") == "tcp://10.1.2.3:5600"
    assert advertised_address("tcp://127.0.0.1:5600", "fd00::5") == "tcp://[fd00::5]:5600"


def test_a_loopback_address_is_never_advertised_to_a_router_elsewhere():
    with pytest.raises(ValueError, match="loopback.*--advertise-address"):
        advertised_address("tcp://127.0.0.1:5600", toward="tcp://10.9.8.7:7000")
    with pytest.raises(ValueError, match="loopback"):
        advertised_address("tcp://0.0.0.0:5600", "localhost", toward="tcp://router:7000")


def test_heartbeat_registers_reports_and_says_goodbye():
    router = ServerSocket("tcp://127.0.0.1:0")
    heartbeat = Heartbeat(router.address, interval_s=0.05)
    heartbeat.register = REGISTER
    heartbeat.set_stats(STATS)
    heartbeat.start()
    try:
        received, deadline = [], time.monotonic() + 5
        while len(received) < 6 and time.monotonic() < deadline:
            routed = router.recv(timeout=0.1)
            if routed is not None:
                received.append(routed.msg)
        assert received[:2] == [REGISTER, STATS], "each beat repeats Register, then the latest stats"
        assert received.count(REGISTER) >= 3, "beats keep coming"
        heartbeat.stop()
        last = None
        while (routed := router.recv(timeout=1.0)) is not None:  # beats still queued, then the goodbye
            last = routed.msg
        assert last == Deregister(engine_id="prefill-0", control_address="tcp://10.0.0.3:5600")
    finally:
        heartbeat.stop()
        router.close()


def test_heartbeat_goes_quiet_while_the_engine_loop_stalls_and_resumes_after():
    router = ServerSocket("tcp://127.0.0.1:0")
    heartbeat = Heartbeat(router.address, interval_s=0.05, stall_s=0.3)
    heartbeat.register = REGISTER
    heartbeat.set_stats(STATS)  # the loop's last progress; it hands over nothing more for now
    heartbeat.start()
    try:
        def beats_within(seconds: float) -> list:
            received, deadline = [], time.monotonic() + seconds
            while time.monotonic() < deadline:
                routed = router.recv(timeout=0.05)
                if routed is not None:
                    received.append(routed.msg)
            return received

        assert REGISTER in beats_within(0.2), "beats while the loop is fresh"
        beats_within(0.3)  # the stall bound passes
        assert beats_within(0.5) == [], "a stuck loop is not kept alive in the router's eyes"
        heartbeat.set_stats(STATS)  # the loop goes round again
        assert REGISTER in beats_within(0.3)
    finally:
        heartbeat.stop()
        router.close()
