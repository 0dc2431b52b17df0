"""One prefill transfer's state through its life, over real sockets: the prompt computed before or
after its KVWant, acked, never asked for, or given up by the decode engine; the scheduler side tells
the scheduler when the blocks may go and which requests to abort."""

from __future__ import annotations

import time

from pdserve.control.messages import Abort
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.kvtransfer.messages import KVAck, KVDone, KVLayer, KVWant
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.transfers import TransferState
from tests.prefill.test_layer_streaming import BLOCK_IDS, PROMPT_LEN, _wait_until, link  # noqa: F401


def _computed_prompt(request_id: str = "r") -> Request:
    """A prompt this engine has computed, with its first token sampled."""
    request = Request(request_id, list(range(PROMPT_LEN)), SamplingParams(max_tokens=1), max_tokens=1)
    request.append_output_token(7)
    request.status = RequestStatus.FINISHED_LENGTH
    return request


def _wait_for_state(side, request_id: str, state: TransferState) -> None:
    def reached() -> bool:
        side.receive()
        transfer = side.transfers.get(request_id)  # None until the KVWant has arrived
        return transfer is not None and transfer.state is state

    _wait_until(reached)


def test_prompt_computed_first_is_sent_on_its_want_and_freed_on_the_ack(link):  # noqa: F811
    side, client, _ = link
    scheduler_side = PrefillSchedulerSide(side)
    assert scheduler_side.on_request_finished(_computed_prompt(), BLOCK_IDS), "blocks wait for the peer"
    assert side.transfers["r"].state is TransferState.WAITING_FOR_WANT
    client.send(KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_for_state(side, "r", TransferState.AWAITING_ACK)
    layer, done = client.recv(timeout=5).msg, client.recv(timeout=5).msg
    assert isinstance(layer, KVLayer) and layer.num_tokens == PROMPT_LEN
    assert isinstance(done, KVDone) and done.first_token == 7
    assert not scheduler_side.poll().sent, "held until the ack"
    client.send(KVAck(request_id="r", ok=True))
    _wait_for_state(side, "r", TransferState.DONE)
    assert scheduler_side.poll().sent == {"r"} and "r" not in side.transfers
    assert side.stats.num_kv_transfers == 1 and side.stats.kv_bytes_sent == layer.nbytes


def test_want_first_then_prompt_computed_sends_once_the_step_is_published(link):  # noqa: F811
    """Inside the step only noted; sent when the engine loop has published the step's first tokens."""
    side, client, _ = link
    scheduler_side = PrefillSchedulerSide(side)
    client.send(KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_for_state(side, "r", TransferState.WAITING_FOR_PROMPT)
    assert scheduler_side.on_request_finished(_computed_prompt(), BLOCK_IDS)
    assert side.transfers["r"].state is TransferState.WAITING_FOR_PROMPT and client.recv(timeout=0.1) is None
    side.send_computed()
    assert side.transfers["r"].state is TransferState.AWAITING_ACK
    assert isinstance(client.recv(timeout=5).msg, KVLayer) and isinstance(client.recv(timeout=5).msg, KVDone)


def test_a_prompt_nobody_asks_for_is_freed_after_the_want_timeout(link):  # noqa: F811
    side, _, _ = link
    side.want_timeout_s = 0.1
    scheduler_side = PrefillSchedulerSide(side)
    scheduler_side.on_request_finished(_computed_prompt(), BLOCK_IDS)
    time.sleep(0.2)
    side.receive()
    assert side.transfers["r"].state is TransferState.FAILED
    assert scheduler_side.poll().sent == {"r"}


def test_the_decode_engine_giving_up_aborts_the_request_here(link):  # noqa: F811
    """Abort from the decode engine: while the prompt computes (no KVWant yet), and once it is held."""
    side, client, _ = link
    scheduler_side = PrefillSchedulerSide(side)
    scheduler_side.on_request_finished(_computed_prompt("held"), BLOCK_IDS)
    client.send(Abort(request_id="computing", reason="gave up"))
    client.send(Abort(request_id="held", reason="gave up"))
    _wait_until(lambda: side.receive() or "computing" in side.transfers)
    _wait_for_state(side, "held", TransferState.ABORTED)
    assert scheduler_side.poll().aborted == {"computing", "held"} and not side.transfers
