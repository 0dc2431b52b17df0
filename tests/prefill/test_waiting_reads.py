"""PrefillTransferSide.layer_hook with layer streaming off: while a computed prompt waits on its decode
engine, the layer boundaries of the next step read the KV socket, so a KVWant is answered and a KVAck
taken mid-step; when nothing waits, nothing is read (real sockets, a hand-made KV cache and plan)."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.messages import KVAck, KVDone, KVLayer, KVWant
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.transfers import TransferState
from pdserve.prefill.waiting_reads import READ_INTERVAL_S, WaitingTransferReads
from tests.prefill.test_layer_streaming import BLOCK_IDS, NUM_LAYERS, PROMPT_LEN, _plan, _wait_until, link  # noqa: F401
from tests.prefill.test_transfer_states import _computed_prompt


@pytest.fixture
def side(link, monkeypatch):  # noqa: F811 - the fixture imported above
    """The transfer side without layer streaming (the CPU default), its client, and a count of its reads."""
    side, client, _ = link
    side.stream_layers = False
    reads = []
    drain = side.server.drain
    monkeypatch.setattr(side.server, "drain", lambda *args, **kwargs: reads.append(1) or drain(*args, **kwargs))
    return side, client, reads


def _run_layers(hook, layers) -> None:
    for layer in layers:
        hook(layer)


def test_no_hook_and_no_read_when_no_transfer_waits(side):
    side, _, reads = side
    assert side.layer_hook(_plan("computing")) is None
    PrefillSchedulerSide(side).on_request_finished(_computed_prompt("acked"), BLOCK_IDS)
    side.transfers["acked"].move(TransferState.DONE, "acked")  # ended: no longer waits
    assert side.layer_hook(_plan("computing")) is None
    assert reads == []


def test_a_want_during_a_step_is_answered_at_a_layer_boundary_and_the_ack_taken(side):
    side, client, reads = side
    PrefillSchedulerSide(side).on_request_finished(_computed_prompt("early"), BLOCK_IDS)  # an earlier step's
    hook = side.layer_hook(_plan("computing"))  # the next step, computing another prompt
    assert hook is not None, "a computed prompt waits for its KVWant: the step must listen"
    client.send(KVWant(request_id="early", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: hook(0) or side.transfers["early"].state is TransferState.AWAITING_ACK)
    layer, done = client.recv(timeout=5).msg, client.recv(timeout=5).msg
    assert isinstance(layer, KVLayer) and layer.num_tokens == PROMPT_LEN and layer.layer_end == NUM_LAYERS
    assert isinstance(done, KVDone) and done.first_token == 7

    client.send(KVAck(request_id="early", ok=True))
    _wait_until(lambda: hook(1) or side.transfers["early"].state is TransferState.DONE)
    assert side.stats.num_kv_transfers == 1 and side.stats.kv_transfer_seconds > 0
    reads_while_waiting = len(reads)
    _run_layers(hook, range(2, NUM_LAYERS))
    assert len(reads) == reads_while_waiting, "nothing waits any more: the rest of the step reads nothing"


def test_reads_are_spaced_in_time(side):
    """Many short layers (a GPU launching ahead, a tiny step) read the socket once per interval."""
    side, _, reads = side
    PrefillSchedulerSide(side).on_request_finished(_computed_prompt("early"), BLOCK_IDS)
    now = [100.0]
    hook = WaitingTransferReads(side, clock=lambda: now[0])
    _run_layers(hook, range(NUM_LAYERS))
    assert len(reads) == 1
    now[0] += READ_INTERVAL_S / 2
    hook(0)
    assert len(reads) == 1
    now[0] += READ_INTERVAL_S
    hook(1)
    assert len(reads) == 2
