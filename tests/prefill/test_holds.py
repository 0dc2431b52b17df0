"""A decode engine that cannot take a prompt yet, over real sockets: its KVHold keeps the computed prompt
past --kv-want-timeout; a KVWant for a prompt still queued here waits for it; a KVWant that comes after
the KV was released is answered at once with why; a prompt the decode engines wait on gets blocks held
for one nobody asked for; a request that ends at its first token holds nothing."""

from __future__ import annotations

import time

import pytest

from pdserve.control.messages import Error
from pdserve.kvtransfer.messages import KVDone, KVHold, KVLayer, KVWant
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.transfers import TransferState
from tests.prefill.test_layer_streaming import BLOCK_IDS, PROMPT_LEN, _wait_until, link  # noqa: F401
from tests.prefill.test_transfer_states import _computed_prompt


def _handled(side, client, request_id: str = "marker") -> None:
    """Everything the client sent before this call has been handled (a link keeps its order)."""
    client.send(KVWant(request_id=request_id, skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or request_id in side.transfers)
    del side.transfers[request_id]


def _expired(side, seconds: float) -> None:
    time.sleep(seconds)
    side.receive()


def test_a_hold_before_the_prompt_is_computed_keeps_it_past_the_want_timeout(link):  # noqa: F811
    side, client, _ = link
    side.want_timeout_s, side.hold_timeout_s = 0.1, 0.6
    scheduler_side = PrefillSchedulerSide(side)
    client.send(KVHold(request_id="held"))
    _handled(side, client)
    assert scheduler_side.on_request_finished(_computed_prompt("held"), BLOCK_IDS)
    scheduler_side.on_request_finished(_computed_prompt("unclaimed"), BLOCK_IDS)
    _expired(side, 0.25)
    assert side.transfers["held"].state is TransferState.WAITING_FOR_WANT, "a decode engine has it queued"
    assert side.transfers["unclaimed"].state is TransferState.FAILED
    assert scheduler_side.poll().sent == {"unclaimed"}
    client.send(KVWant(request_id="held", skip_tokens=0, num_tokens=PROMPT_LEN))  # the decode engine has room now
    _wait_until(lambda: side.receive() or side.transfers["held"].state is TransferState.AWAITING_ACK)
    assert isinstance(client.recv(timeout=5).msg, KVLayer) and isinstance(client.recv(timeout=5).msg, KVDone)


def test_a_hold_after_the_prompt_is_computed_counts_too_and_ends_at_the_hold_timeout(link):  # noqa: F811
    side, client, _ = link
    side.want_timeout_s, side.hold_timeout_s = 0.1, 0.4
    scheduler_side = PrefillSchedulerSide(side)
    scheduler_side.on_request_finished(_computed_prompt("held"), BLOCK_IDS)
    client.send(KVHold(request_id="held"))
    _handled(side, client)
    _expired(side, 0.2)
    assert side.transfers["held"].state is TransferState.WAITING_FOR_WANT
    _expired(side, 0.3)
    assert side.transfers["held"].state is TransferState.FAILED
    assert "--kv-hold-timeout" in side.transfers["held"].reason
    assert scheduler_side.poll().sent == {"held"} and not side._holds
    assert side.stats.num_kv_transfers_failed == 1 and side.stats.num_kv_transfers == 0


def test_a_want_for_a_prompt_queued_here_waits_for_it(link):  # noqa: F811
    """The KVWant came first and the prompt waits in this engine's queue longer than --kv-want-timeout:
    not 'never received' (the old answer, which made the decode engine compute the prompt itself)."""
    side, client, _ = link
    side.want_timeout_s = 0.1
    queued = {"r"}
    side.bind_scheduler(queued.__contains__, lambda request_id: False)
    client.send(KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or "r" in side.transfers)
    _expired(side, 0.25)
    assert side.transfers["r"].state is TransferState.WAITING_FOR_PROMPT and client.recv(timeout=0.05) is None
    PrefillSchedulerSide(side).on_request_finished(_computed_prompt("r"), BLOCK_IDS)
    side.send_computed()
    assert isinstance(client.recv(timeout=5).msg, KVLayer) and isinstance(client.recv(timeout=5).msg, KVDone)


def test_a_want_after_the_kv_was_released_is_answered_at_once_with_why(link):  # noqa: F811
    side, client, _ = link
    side.want_timeout_s = 0.1
    scheduler_side = PrefillSchedulerSide(side)
    scheduler_side.on_request_finished(_computed_prompt("late"), BLOCK_IDS)
    _expired(side, 0.2)
    assert scheduler_side.poll().sent == {"late"} and "late" not in side.transfers
    side.want_timeout_s = 60.0  # the answer must not wait for a bound
    client.send(KVWant(request_id="late", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or client.socket.poll(0))
    reply = client.recv(timeout=5).msg
    assert isinstance(reply, Error) and reply.code == "kv_released" and reply.request_id == "late"
    assert "no KVWant within 0.1s (--kv-want-timeout)" in reply.message and "late" not in side.transfers


def test_blocks_held_for_nobody_go_to_a_prompt_a_decode_engine_waits_on(link):  # noqa: F811
    """Two computed prompts nobody asked for hold the blocks; a decode engine has reserved blocks for a third,
    queued here behind the want of blocks: the oldest held one is released (one at a time), then the next."""
    side, client, _ = link
    scheduler_side = PrefillSchedulerSide(side)
    starved: set[str] = set()
    side.bind_scheduler(lambda request_id: request_id == "wanted", starved.__contains__)
    scheduler_side.on_request_finished(_computed_prompt("old"), BLOCK_IDS)
    scheduler_side.on_request_finished(_computed_prompt("new"), BLOCK_IDS)
    client.send(KVWant(request_id="wanted", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or "wanted" in side.transfers)
    assert side.transfers["old"].state is TransferState.WAITING_FOR_WANT, "the wanted prompt has blocks"
    starved.add("wanted")
    side.receive()
    assert side.transfers["old"].state is TransferState.FAILED
    assert side.transfers["new"].state is TransferState.WAITING_FOR_WANT, "one at a time"
    side.receive()
    assert side.transfers["new"].state is TransferState.WAITING_FOR_WANT, "not before the first one's blocks went"
    assert scheduler_side.poll().sent == {"old"}
    side.receive()
    assert side.transfers["new"].state is TransferState.FAILED
    client.send(KVWant(request_id="old", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or client.socket.poll(0))
    reply = client.recv(timeout=5).msg
    assert reply.code == "kv_released" and "a decode engine was waiting on" in reply.message


def test_a_request_that_ends_at_its_first_token_holds_no_blocks(link):  # noqa: F811
    """max_tokens=1: the router sends it to no decode engine, so its blocks go at once; if a decode engine
    asked for it all the same (its KVHold or KVWant came), it is served."""
    side, client, _ = link
    scheduler_side = PrefillSchedulerSide(side)
    side.first_token_ends = {"alone", "asked", "claimed"}.__contains__
    assert not scheduler_side.on_request_finished(_computed_prompt("alone"), BLOCK_IDS)
    client.send(KVHold(request_id="claimed"))
    client.send(KVWant(request_id="asked", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or "asked" in side.transfers)
    assert scheduler_side.on_request_finished(_computed_prompt("asked"), BLOCK_IDS)
    assert scheduler_side.on_request_finished(_computed_prompt("claimed"), BLOCK_IDS)
    assert set(side.transfers) == {"asked", "claimed"}


def test_a_bound_that_is_not_positive_is_refused_naming_its_flag():
    from pdserve.prefill.transfer_side import PrefillTransferSide

    for keyword, flag in (("want_timeout_s", "--kv-want-timeout"), ("hold_timeout_s", "--kv-hold-timeout"),
                          ("lease_s", "--kv-lease")):
        with pytest.raises(ValueError, match=f"{flag} 0 must be > 0 seconds"):
            PrefillTransferSide(None, None, **{keyword: 0})
