"""A dual-role engine registers with its router as role "dual" with the KV address peers pull from, and
pulls KV from the engines its router lists (KVPeers), dual ones included, as a decode engine does."""

from __future__ import annotations

import time

from pdserve.control.messages import EngineStats, KVPeers, Register
from pdserve.control.sockets import ServerSocket
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, assert_no_leaks, colocated_tokens
from tests.decode.test_faults import wait_for_log


def wait_for_register(router: ServerSocket, timeout_s: float = 20.0) -> tuple[bytes, Register, EngineStats]:
    """The first heartbeat: (its peer id, the Register, the EngineStats that come with it)."""
    deadline = time.monotonic() + timeout_s
    register = None
    while time.monotonic() < deadline:
        received = router.recv(timeout=0.5)
        if received is not None and isinstance(received.msg, Register):
            register = received.msg
        elif received is not None and isinstance(received.msg, EngineStats) and register is not None:
            return received.peer_id, register, received.msg
    raise TimeoutError("the dual engine did not register")


def test_a_dual_engine_registers_as_dual_and_pulls_from_the_peers_its_router_lists(model_factory, tmp_path):
    model_dir = model_factory("llama")
    router = ServerSocket("tcp://127.0.0.1:0")
    peer = EngineProcess("engine", model_dir, *ENGINE_ARGS, "--kv-streaming", "on", "--kv-want-timeout", "3",
                         log_dir=tmp_path)
    dual = EngineProcess("engine", model_dir, *ENGINE_ARGS, "--router-address", router.address,
                         "--heartbeat-interval", "0.2", log_dir=tmp_path)
    driver = Driver(dual, peer)
    try:
        expected = colocated_tokens(model_dir, PROMPTS[:2], **GREEDY)
        peer_id, register, stats = wait_for_register(router)
        assert register.role == stats.role == "dual"
        assert register.kv_address == dual.addresses["kv"] and register.control_address == dual.addresses["control"]
        router.send(peer_id, KVPeers(kv_addresses=(peer.addresses["kv"],)), timeout=2.0)
        wait_for_log(dual, f"lists them: {[peer.addresses['kv']]}")  # its heartbeat thread took it
        listed, = driver.generate([PROMPTS[0]], prefix="listed", **GREEDY)
        assert listed.token_ids == expected[0]
        assert driver.decode_stats().kv_bytes_received > 0, "the KV came from the listed dual engine"
        router.send(peer_id, KVPeers(kv_addresses=()), timeout=2.0)  # the peer left the router
        wait_for_log(dual, "lists them: none")
        received = driver.decode_stats().kv_bytes_received
        unlisted, = driver.generate([PROMPTS[1]], prefix="unlisted", **GREEDY)
        assert unlisted.token_ids == expected[1]
        assert driver.decode_stats().kv_bytes_received == received, "no KV from an engine no longer listed"
        assert_no_leaks(driver)  # the peer computed the unlisted prompt too: its KV goes after its 3 s --kv-want-timeout
    finally:
        driver.close()
        router.close()
        peer.stop()
        dual.stop()
