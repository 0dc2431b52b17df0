"""The prefill side's view of incarnations, over real sockets: its answers name its incarnation, `no_hello`
names the request it refused, and a decode engine that says Hello with a new incarnation of its engine id has
restarted: what was held for its predecessor goes at once."""

from __future__ import annotations

import pytest
import torch

from pdserve.control.messages import Error
from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.kvtransfer.messages import Hello, HelloAck, KVHold, KVWant
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.transfer_side import PrefillTransferSide
from pdserve.prefill.transfers import TransferState
from tests.prefill.test_layer_streaming import (
    BLOCK_IDS,
    BLOCK_SIZE,
    HEAD_DIM,
    KV_HEADS,
    NUM_BLOCKS,
    NUM_LAYERS,
    PROMPT_LEN,
    _wait_until,
)
from tests.prefill.test_transfer_states import _computed_prompt

INCARNATION = "0123456789abcdef"
FINGERPRINT = LayoutFingerprint(architecture="LlamaForCausalLM", num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS,
                                head_dim=HEAD_DIM, dtype="float32", block_size=BLOCK_SIZE, weights_hash="w")


@pytest.fixture
def side():
    side = PrefillTransferSide(ServerSocket("tcp://127.0.0.1:0"), FINGERPRINT, incarnation=INCARNATION)
    side.bind_kv_cache(torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    clients: list[ClientSocket] = []
    side.client = lambda: clients.append(ClientSocket(side.server.address)) or clients[-1]
    yield side
    for client in clients:
        client.close()
    side.close()


def answer(side: PrefillTransferSide, client: ClientSocket, msg):
    """What the prefill side answers msg with (None: nothing)."""
    client.send(msg, timeout=5)
    _wait_until(lambda: side.receive() or client.socket.poll(0))
    return client.recv(timeout=5).msg


def handled(side: PrefillTransferSide, client: ClientSocket) -> None:
    """Until the prefill side has handled what client sent so far: a message it does not serve comes after them,
    and is answered with an error."""
    refusal = answer(side, client, HelloAck(ok=True))
    assert isinstance(refusal, Error) and refusal.code == "unexpected" and refusal.incarnation == INCARNATION


def hello(side: PrefillTransferSide, incarnation: str, engine_id: str = "d0") -> ClientSocket:
    client = side.client()
    ack = answer(side, client, Hello(fingerprint=FINGERPRINT.to_dict(), role="decode", engine_id=engine_id,
                                     incarnation=incarnation))
    assert isinstance(ack, HelloAck) and ack.ok and ack.incarnation == INCARNATION
    return client


def test_no_hello_names_the_request_and_the_incarnation(side):
    refusal = answer(side, side.client(), KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    assert isinstance(refusal, Error) and refusal.code == "no_hello"
    assert refusal.request_id == "r" and refusal.incarnation == INCARNATION
    assert "r" not in side.transfers, "nothing is served before a Hello"


def test_a_restarted_decode_engines_predecessor_loses_what_was_held_for_it(side):
    scheduler_side = PrefillSchedulerSide(side)
    first = hello(side, "aaaa")
    other = hello(side, "cccc", engine_id="d1")  # another decode engine: untouched
    for client, request_id in ((first, "held"), (first, "queued"), (other, "others")):
        client.send(KVHold(request_id=request_id), timeout=5)
    first.send(KVWant(request_id="asked", skip_tokens=0, num_tokens=PROMPT_LEN), timeout=5)
    handled(side, first)
    handled(side, other)
    for request_id in ("held", "others"):  # computed after their KVHold: kept for the decode engine
        assert scheduler_side.on_request_finished(_computed_prompt(request_id), BLOCK_IDS)
    assert side.transfers["held"].held_by_peer and side.transfers["others"].held_by_peer

    hello(side, "bbbb")  # d0 again, a new process
    assert side.transfers["held"].state is TransferState.FAILED, "its blocks go at the next poll"
    assert side.transfers["asked"].state is TransferState.ABORTED, "the prompt it asked for is not computed"
    assert "restarted" in side.transfers["held"].reason
    assert side.transfers["others"].state is TransferState.WAITING_FOR_WANT
    assert not side.take_hold("queued"), "the predecessor's KVHold for a prompt still queued is forgotten"
    events = scheduler_side.poll()
    assert events.sent == {"held"} and events.aborted == {"asked"}


def test_the_same_incarnation_saying_hello_again_keeps_what_is_held(side):
    """A new link from the same process (its old one was dropped) is not a restart."""
    scheduler_side = PrefillSchedulerSide(side)
    first = hello(side, "aaaa")
    first.send(KVHold(request_id="held"), timeout=5)
    handled(side, first)
    assert scheduler_side.on_request_finished(_computed_prompt("held"), BLOCK_IDS)
    hello(side, "aaaa")
    assert side.transfers["held"].state is TransferState.WAITING_FOR_WANT
    assert scheduler_side.poll().sent == set()
