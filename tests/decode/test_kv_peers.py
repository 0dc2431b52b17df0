"""A decode engine pulls KV only from prefill engines it trusts: those given with --kv-peer, and those
its own router lists (KVPeers on the registration link). A GenerateRequest naming any other address
is prefilled locally, and the named address never hears from the decode engine."""

from __future__ import annotations

import time

from pdserve.control.messages import GenerateRequest, KVPeers, Register
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.sockets import ServerSocket
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, assert_no_leaks, colocated_tokens
from tests.decode.test_disaggregated import start_at_free_kv_addresses, stop_together
from tests.decode.test_faults import wait_for_log


def send_generate(driver: Driver, request_id: str, prompt: list[int], kv_address: str) -> None:
    driver.decode.send(GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                       sampling_params=SamplingParams(**GREEDY), prefill_kv_address=kv_address))


def test_a_request_naming_an_unknown_kv_sender_is_prefilled_locally(model_factory, tmp_path):
    model_dir = model_factory("llama")
    rogue = ServerSocket("tcp://127.0.0.1:0")  # would serve forged KV if the decode engine came to it
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-address", kv[0], "--kv-streaming", "on",
                                    log_dir=tmp_path),
        lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, "--kv-peer", kv[0], log_dir=tmp_path))
    driver = Driver(decode, prefill)
    try:
        expected = colocated_tokens(model_dir, PROMPTS[:3], **GREEDY)
        for i, prompt in enumerate(PROMPTS[:2]):
            send_generate(driver, f"forged{i}", prompt, rogue.address)
        results = driver.collect(["forged0", "forged1"])
        assert [results[f"forged{i}"].token_ids for i in range(2)] == expected[:2]
        assert rogue.recv(timeout=1.0) is None, "the decode engine never connected to the named address"
        assert driver.decode_stats().num_kv_transfers == 0
        trusted, = driver.generate([PROMPTS[2]], prefix="trusted", **GREEDY)
        assert trusted.token_ids == expected[2]
        assert driver.decode_stats().num_kv_transfers == 1, "the --kv-peer prefill engine still serves KV"
        assert "neither registered with this engine's router nor was given with --kv-peer" in decode.log()
        assert_no_leaks(driver)
    finally:
        driver.close()
        rogue.close()
        stop_together(prefill, decode)


def wait_for_register(router: ServerSocket, timeout_s: float = 20.0) -> bytes:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        received = router.recv(timeout=0.5)
        if received is not None and isinstance(received.msg, Register):
            return received.peer_id
    raise TimeoutError("the decode engine did not register")


def test_the_routers_kv_peers_are_trusted_and_replaced_whole(model_factory, tmp_path):
    """The decode engine registers with a router (a socket here) and trusts the prefill engines the
    router lists, only while it lists them."""
    model_dir = model_factory("llama")
    router = ServerSocket("tcp://127.0.0.1:0")
    prefill = EngineProcess("prefill", model_dir, *ENGINE_ARGS, "--kv-streaming", "on", log_dir=tmp_path)
    decode = EngineProcess("decode", model_dir, *ENGINE_ARGS, "--router-address", router.address,
                           "--heartbeat-interval", "0.2", log_dir=tmp_path)
    driver = Driver(decode, prefill)
    try:
        expected = colocated_tokens(model_dir, PROMPTS[:2], **GREEDY)
        peer = wait_for_register(router)
        router.send(peer, KVPeers(kv_addresses=(prefill.addresses["kv"],)), timeout=2.0)
        wait_for_log(decode, f"lists them: {[prefill.addresses['kv']]}")  # its heartbeat thread took it
        first, = driver.generate([PROMPTS[0]], prefix="listed", **GREEDY)
        assert first.token_ids == expected[0]
        assert driver.decode_stats().num_kv_transfers == 1, "KV came from the listed prefill engine"
        router.send(peer, KVPeers(kv_addresses=()), timeout=2.0)  # the prefill engine left the router
        wait_for_log(decode, "lists them: none")
        prefill_client, driver.prefill = driver.prefill, None  # no PrefillRequest: D must not ask P for this one
        prefill_client.close()
        send_generate(driver, "unlisted", PROMPTS[1], prefill.addresses["kv"])
        assert driver.collect(["unlisted"])["unlisted"].token_ids == expected[1]
        assert driver.decode_stats().num_kv_transfers == 1, "no transfer from a prefill engine no longer listed"
    finally:
        driver.close()
        router.close()
        prefill.stop()
        decode.stop()
