"""Messages about requests the prefill engine does not know: answered or ignored, never fatal."""

from __future__ import annotations

import time

from pdserve.control.messages import Error
from pdserve.kvtransfer.messages import KVAck, KVWant
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from tests.prefill.test_layer_streaming import _wait_until, link  # noqa: F401  (link is a fixture)


def test_a_want_for_a_prompt_that_never_comes_is_answered_unknown_request(link):  # noqa: F811
    side, client, _ = link
    side.want_timeout_s = 0.2
    client.send(KVWant(request_id="ghost", skip_tokens=0, num_tokens=8))
    _wait_until(lambda: side.receive() or "ghost" in side.transfers)  # it may still come: wait
    time.sleep(0.3)
    side.receive()  # the bound has passed
    reply = client.recv(timeout=5)
    assert isinstance(reply.msg, Error) and reply.msg.code == "unknown_request"
    assert reply.msg.request_id == "ghost" and "ghost" not in side.transfers


def test_an_ack_for_an_unknown_request_changes_nothing(link):  # noqa: F811
    side, client, _ = link
    client.send(KVAck(request_id="nobody", ok=True))
    client.send(KVWant(request_id="marker", skip_tokens=0, num_tokens=8))  # same link, so handled after the ack
    _wait_until(lambda: side.receive() or "marker" in side.transfers)  # the ack has been handled
    events = PrefillSchedulerSide(side).poll()
    assert not events.sent and side.stats.num_kv_transfers == 0
    assert client.recv(timeout=0.05) is None  # nothing to answer
