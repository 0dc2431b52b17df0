"""The dual-role connector hands each hook to the role it concerns (unit test of dualrole/connector.py,
with recording stand-ins for the two roles' sides)."""

from __future__ import annotations

import pytest

from pdserve.dualrole.connector import DualSchedulerSide, DualTransferSide
from pdserve.engine.kv_connector import ConnectorEvents, KVConnectorStats


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
