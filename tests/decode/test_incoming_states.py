"""One decode transfer's state through its life, against a stand-in prefill engine on a real socket:
received and verified, or timed out (the prefill engine is told to stop); the scheduler side reports
each once."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.decode.incoming import IncomingState
from pdserve.decode.scheduler_side import DecodeSchedulerSide
from pdserve.decode.transfer_side import DecodeTransferSide
from pdserve.engine.request import Request, SamplingParams
from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.control.messages import Abort
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVDone, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums
from pdserve.control.sockets import ServerSocket

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 4, 4, 2, 8
PROMPT_LEN = 8  # two blocks


def recv_flushing(server: ServerSocket, side: DecodeTransferSide, timeout_s: float = 5.0):
    """The next message D sends to `server`: D's loop (side.receive) hands its links' outboxes to the
    sockets once they connect, so it goes round meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        side.receive()
        received = server.recv(timeout=0.02)
        if received is not None:
            return received
    raise TimeoutError(f"the decode side sent nothing to {server.address} within {timeout_s}s")


def decode_sides() -> tuple[DecodeSchedulerSide, DecodeTransferSide]:
    fingerprint = LayoutFingerprint(architecture="LlamaForCausalLM", num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, dtype="float32", block_size=BLOCK_SIZE, weights_hash="w")
    side = DecodeTransferSide(fingerprint, "d0", timeout_s=5)
    side.bind_kv_cache(torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    return DecodeSchedulerSide(side), side


def ask_for(scheduler_side: DecodeSchedulerSide, request_id: str, prefill: ServerSocket, blocks: list[int]) -> None:
    """Blocks allocated for a request whose prompt `prefill` computes: its KVWant goes out."""
    request = Request(request_id, list(range(PROMPT_LEN)), SamplingParams(max_tokens=2), max_tokens=2)
    request.prefill_kv_address = prefill.address
    scheduler_side.on_blocks_allocated(request, blocks, PROMPT_LEN)


@pytest.fixture
def pair():
    """(decode scheduler side, decode transfer side, stand-in prefill server, D's peer id there)."""
    prefill = ServerSocket("tcp://127.0.0.1:0")
    scheduler_side, side = decode_sides()
    ask_for(scheduler_side, "r", prefill, [3, 1])
    hello = recv_flushing(prefill, side)
    assert isinstance(hello.msg, Hello)
    prefill.send(hello.peer_id, HelloAck(ok=True))
    assert isinstance(recv_flushing(prefill, side).msg, KVWant)
    yield scheduler_side, side, prefill, hello.peer_id
    side.close()
    prefill.close()


def _send_kv(prefill: ServerSocket, peer_id: bytes, kv: torch.Tensor) -> KVLayer:
    """All of request r's KV in one KVLayer, then its KVDone (first token 5)."""
    msg, payload = KVLayer.from_tensor(kv, request_id="r", layer_start=0, token_start=0)
    prefill.send(peer_id, msg, payload)
    prefill.send(peer_id, KVDone(request_id="r", first_token=5, num_tokens=PROMPT_LEN,
                                 checksum=combine_checksums([msg.checksum])))
    return msg


def _receive_until(side, condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        side.receive()
        time.sleep(0.005)


def test_verified_kv_is_received_once_and_acked(pair):
    scheduler_side, side, prefill, peer_id = pair
    kv = torch.randn(NUM_LAYERS, 2, PROMPT_LEN, KV_HEADS, HEAD_DIM)
    msg = _send_kv(prefill, peer_id, kv)
    _receive_until(side, lambda: side.transfers["r"].state is IncomingState.RECEIVED)
    ack = prefill.recv(timeout=5).msg
    assert isinstance(ack, KVAck) and ack.ok
    torch.testing.assert_close(side.writer.kv_cache[:, :, [3, 1]].flatten(2, 3), kv, rtol=0, atol=0)
    assert scheduler_side.poll().received == {"r": (5, None)}
    assert not scheduler_side.poll().received, "reported once"
    assert side.stats.num_kv_transfers == 1 and side.stats.kv_bytes_received == msg.nbytes


def _fails_and_aborts_the_prefill(scheduler_side, side, prefill, says: str) -> None:
    assert side.transfers["r"].state is IncomingState.FAILED
    abort = prefill.recv(timeout=5).msg
    assert isinstance(abort, Abort) and abort.request_id == "r"
    events = scheduler_side.poll()
    assert says in events.failed["r"] and side.stats.num_kv_transfers_failed == 1 and not side.transfers


def test_kv_of_a_computed_prompt_that_never_completes_fails_after_the_timeout(pair):
    scheduler_side, side, prefill, _ = pair
    side.timeout_s = 0.3
    time.sleep(0.4)  # longer than timeout_s since the KVWant: the prompt may still be in the prefill queue
    side.receive()
    assert side.transfers["r"].state is IncomingState.RECEIVING, "not computed yet: --kv-queue-timeout bounds it"
    side.prompt_computed("r")  # the router relayed the prefill engine's first token
    time.sleep(0.2)
    side.receive()
    assert side.transfers["r"].state is IncomingState.RECEIVING, "timeout_s counts from the prompt being computed"
    time.sleep(0.2)
    side.receive()
    _fails_and_aborts_the_prefill(scheduler_side, side, prefill, "within 0.3s of the prompt being computed")


def test_a_prompt_never_computed_fails_after_the_queue_timeout(pair):
    scheduler_side, side, prefill, _ = pair
    side.queue_timeout_s = 0.1
    time.sleep(0.2)
    side.receive()
    _fails_and_aborts_the_prefill(scheduler_side, side, prefill, "did not compute the prompt within 0.1s")


def _receive_for(side, seconds: float, until) -> None:
    """Handle what arrives for `seconds`, or until `until()` says something changed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        side.receive()
        time.sleep(0.005)


def _open_second_link(scheduler_side, request_id: str) -> tuple[ServerSocket, bytes]:
    """Another stand-in prefill engine, which D links to for a request of its own."""
    other = ServerSocket("tcp://127.0.0.1:0")
    ask_for(scheduler_side, request_id, other, [0, 2])
    hello = recv_flushing(other, scheduler_side.transfer_side)
    other.send(hello.peer_id, HelloAck(ok=True))
    assert isinstance(recv_flushing(other, scheduler_side.transfer_side).msg, KVWant)
    return other, hello.peer_id


def test_kv_only_counts_on_the_link_it_was_asked_on(pair):
    scheduler_side, side, prefill, peer_id = pair
    other, other_peer = _open_second_link(scheduler_side, "r2")
    try:
        forged = torch.full((NUM_LAYERS, 2, PROMPT_LEN, KV_HEADS, HEAD_DIM), 666.0)
        _send_kv(other, other_peer, forged)  # a linked peer, but "r" was asked of the first one
        other.send(other_peer, Abort(request_id="r", reason="not yours to end"))
        _receive_for(side, 0.5, until=lambda: side.stats.kv_bytes_received or side.transfers["r"].state
                     is not IncomingState.RECEIVING)  # long enough for all three to arrive and be handled
        assert side.transfers["r"].state is IncomingState.RECEIVING, "nothing from the other link counts"
        assert not side.writer.kv_cache.eq(666.0).any(), "forged KV never reaches the cache"
        kv = torch.randn(NUM_LAYERS, 2, PROMPT_LEN, KV_HEADS, HEAD_DIM)
        _send_kv(prefill, peer_id, kv)
        _receive_until(side, lambda: side.transfers["r"].state is IncomingState.RECEIVED)
        torch.testing.assert_close(side.writer.kv_cache[:, :, [3, 1]].flatten(2, 3), kv, rtol=0, atol=0)
    finally:
        other.close()


def test_aborting_on_a_dead_link_never_waits(pair):
    scheduler_side, side, prefill, _ = pair
    prefill.close()  # the prefill engine is gone: nothing takes messages for it any more
    time.sleep(0.2)
    incoming = side.transfers["r"]
    started = time.monotonic()
    for _ in range(50):  # as if 50 requests in flight on that link were aborted one after another
        side.abort(incoming, "aborted on decode")
    assert time.monotonic() - started < 0.5, "each Abort to a dead peer must be dropped at once, not waited on"


def test_a_request_after_a_refused_link_fails_with_the_same_reason():
    """Which requests a refusal finds asked depends on timing (a request's KVWant may come after the HelloAck
    was read): each gets the prefill engine's reason in the same words, not 'cannot reach' for the later ones."""
    prefill = ServerSocket("tcp://127.0.0.1:0")
    scheduler_side, side = decode_sides()
    try:
        ask_for(scheduler_side, "first", prefill, [0, 1])
        hello = recv_flushing(prefill, side)
        prefill.send(hello.peer_id, HelloAck(ok=False, reason="KV layout mismatch"))
        _receive_until(side, lambda: side.transfers["first"].state is IncomingState.FAILED)
        ask_for(scheduler_side, "later", prefill, [2, 3])
        failed = scheduler_side.poll().failed
        assert failed == {name: "prefill engine refused the KV link: KV layout mismatch" for name in ("first", "later")}
    finally:
        side.close()
        prefill.close()
