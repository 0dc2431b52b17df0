"""The dual-role connector hands each hook to the role it concerns (unit test of dualrole/connector.py,
with recording stand-ins for the two roles' sides)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.decode.incoming import IncomingState
from pdserve.dualrole.connector import DualSchedulerSide, DualTransferSide
from pdserve.engine.kv_connector import ConnectorEvents, KVConnectorStats
from pdserve.prefill.transfers import TransferState


class Recorder:
    """Records each call as (name, args) and answers from `answers`."""

    def __init__(self, **answers) -> None:
        self.calls: list[tuple] = []
        self.answers = answers

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append((name, *args))
            answer = self.answers.get(name)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return call


def test_each_scheduler_hook_goes_to_its_role():
    prefill = Recorder(on_request_finished=True, poll=ConnectorEvents(sent={"p1"}, aborted={"p2"}))
    decode = Recorder(num_external_tokens=12, poll=ConnectorEvents(received={"d1": (5, None)}, failed={"d2": "gone"}))
    side = DualSchedulerSide(prefill, decode)
    assert side.num_external_tokens("req", 4) == 12
    side.on_blocks_allocated("req", [1, 2], 12)
    assert side.on_request_finished("req", [1, 2]) is True, "the prefill role decides what stays held"
    side.on_request_aborted("req")
    assert [c[0] for c in decode.calls] == ["num_external_tokens", "on_blocks_allocated", "on_request_aborted"]
    assert [c[0] for c in prefill.calls] == ["on_request_finished", "on_request_aborted"]
    events = side.poll()
    assert (events.sent, events.aborted) == ({"p1"}, {"p2"})
    assert (events.received, events.failed) == ({"d1": (5, None)}, {"d2": "gone"})


def test_the_transfer_side_drives_both_roles_and_sums_their_figures():
    prefill = Recorder(sockets=["kv-socket"], layer_hook="hook", receive=RuntimeError("prefill bug"))
    decode = Recorder(sockets=["link-1", "link-2"])
    prefill.stats = KVConnectorStats(kv_bytes_sent=100, num_kv_transfers=2, kv_transfer_seconds=0.5)
    decode.stats = KVConnectorStats(kv_bytes_received=70, num_kv_transfers=3, num_kv_transfers_failed=1,
                                    kv_transfer_seconds=0.25)
    side = DualTransferSide(prefill, decode)
    assert side.sockets() == ["kv-socket", "link-1", "link-2"]
    assert side.layer_hook("plan") == "hook"
    with pytest.raises(RuntimeError):
        side.receive()
    assert ("receive",) in decode.calls, "the decode role's links are read even when the prefill role's read raised"
    assert side.stats == KVConnectorStats(kv_bytes_sent=100, kv_bytes_received=70, num_kv_transfers=5,
                                          num_kv_transfers_failed=1, kv_transfer_seconds=0.75)
    side.first_token_ends = ends = lambda request_id: True  # PrefillServer sets it on its transfer side
    assert prefill.first_token_ends is ends
    side.send_computed()
    side.hold("r1", "tcp://peer:1")
    side.prompt_computed("r1")
    assert ("send_computed",) in prefill.calls
    assert [c for c in decode.calls if c[0] in ("hold", "prompt_computed")] == [
        ("hold", "r1", "tcp://peer:1"), ("prompt_computed", "r1")]


class Pull:
    """A pull as the decode role keeps it (decode/incoming.py's IncomingTransfer's fields the release reads)."""

    def __init__(self, request_id: str, started: float, received_tokens: int = 0, computed_at=None) -> None:
        self.request_id, self.started, self.computed_at = request_id, started, computed_at
        self.state, self.reason = IncomingState.RECEIVING, ""
        self.layer_tokens_received = [received_tokens, 0]

    def fail(self, reason: str) -> None:
        self.state, self.reason = IncomingState.FAILED, reason


def release_side(pulls: list[Pull], waits_for_blocks: bool, release_pulls: bool = True):
    wanted = SimpleNamespace(state=TransferState.WAITING_FOR_PROMPT, request_id="wanted")
    prefill = SimpleNamespace(transfers={"wanted": wanted}, waits_for_blocks=lambda request_id: waits_for_blocks,
                              receive=lambda: None)
    aborted = []
    decode = SimpleNamespace(transfers={p.request_id: p for p in pulls}, receive=lambda: None,
                             abort=lambda pull, reason: aborted.append(pull.request_id), stats=KVConnectorStats())
    return DualTransferSide(prefill, decode, release_pulls=release_pulls), aborted


def test_a_prompt_a_peer_waits_on_here_releases_the_newest_idle_pull_one_at_a_time():
    pulls = [Pull("old", 1.0), Pull("new", 2.0), Pull("newest-but-arriving", 3.0, received_tokens=4),
             Pull("computed", 4.0, computed_at=3.5)]
    side, aborted = release_side(pulls, waits_for_blocks=True)
    side.receive()
    assert aborted == ["new"] and pulls[1].state is IncomingState.FAILED and "recomputed" in pulls[1].reason
    assert side.decode.stats.num_kv_transfers_failed == 1
    side.receive()  # the released pull's blocks are not freed yet (its state is still in the table)
    assert aborted == ["new"], "one at a time"
    del side.decode.transfers["new"]
    side.receive()
    assert aborted == ["new", "old"]


@pytest.mark.parametrize("waits_for_blocks, release_pulls", [(False, True), (True, False)])
def test_no_pull_is_released_without_a_waiting_prompt_or_under_kv_failure_fail(waits_for_blocks, release_pulls):
    pulls = [Pull("a", 1.0)]
    side, aborted = release_side(pulls, waits_for_blocks, release_pulls)
    side.receive()
    assert aborted == [] and pulls[0].state is IncomingState.RECEIVING
