"""The decode side's KV link to a prefill engine that restarted on the same address (a stand-in prefill
engine closed and bound again on the same port): the link is renewed with a new socket and a new Hello, what
the new engine refused for want of a Hello goes again, and every transfer asked of the old engine fails at
once (and is aborted on the new one) instead of waiting out its timeout. The restart shows as the link's
connection dropping, as `no_hello` from the new engine (when the old one died before answering the Hello),
as an error naming no request, or as the router's new incarnation."""

from __future__ import annotations

import time

import pytest

from pdserve.control.errors import TransportError
from pdserve.control.messages import Abort, Error
from pdserve.control.sockets import ServerSocket
from pdserve.decode.incoming import IncomingState
from pdserve.decode.kv_peers import KVPeerTrust
from pdserve.kvtransfer.messages import Hello, HelloAck, KVHold, KVWant
from tests.decode.test_incoming_states import ask_for, decode_sides, recv_flushing

OLD, NEW = "aaaa0000aaaa0000", "bbbb1111bbbb1111"  # the prefill engine's incarnations before and after


def said_hello(prefill: ServerSocket, side, incarnation: str) -> bytes:
    """D's Hello on `prefill`, answered with `incarnation`: D's peer id there."""
    hello = recv_flushing(prefill, side)
    assert isinstance(hello.msg, Hello), hello.msg
    assert hello.msg.incarnation == side.incarnation
    prefill.send(hello.peer_id, HelloAck(ok=True, incarnation=incarnation))
    return hello.peer_id


def received(prefill: ServerSocket, side, count: int) -> list:
    """The next `count` messages D sends to `prefill`, as (peer id, message)."""
    return [(item.peer_id, item.msg) for item in (recv_flushing(prefill, side) for _ in range(count))]


def restarted(prefill: ServerSocket) -> ServerSocket:
    """The stand-in prefill engine killed and started again on its address (a new process: no Hello known)."""
    address = prefill.address
    prefill.close()
    time.sleep(0.3)  # D's socket sees the old connection end (a real restart takes seconds): no send falls into it
    deadline = time.monotonic() + 5
    while True:  # ZeroMQ releases the port in its I/O thread, a moment after close
        try:
            return ServerSocket(address)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def asked_old(answer_hello: bool):
    """D asked a stand-in prefill engine for request "old" (Hello, then KVWant; the Hello answered with OLD or
    not at all): (scheduler side, transfer side, the stand-in engine)."""
    scheduler_side, side = decode_sides()
    side.incarnation = "dddd0000dddd0000"
    prefill = ServerSocket("tcp://127.0.0.1:0")
    ask_for(scheduler_side, "old", prefill, [0, 1])
    if answer_hello:
        said_hello(prefill, side, OLD)
    else:
        assert isinstance(recv_flushing(prefill, side).msg, Hello)
    assert isinstance(recv_flushing(prefill, side).msg, KVWant)
    if answer_hello:  # D has read the HelloAck (the KVWant may have left before it came)
        deadline = time.monotonic() + 5
        while not any(link.peer_incarnation == OLD for link in side._links.values()):
            assert time.monotonic() < deadline, "D never read the HelloAck"
            side.receive()
            time.sleep(0.01)
    return scheduler_side, side, prefill


@pytest.fixture
def asked_before_restart():
    """The engine died before it answered D's Hello, and came back on its address: D's socket reconnects to the
    new one silently. Yields (scheduler side, transfer side, the new stand-in engine)."""
    scheduler_side, side, prefill = asked_old(answer_hello=False)
    prefill = restarted(prefill)
    yield scheduler_side, side, prefill
    side.close()
    prefill.close()


def test_a_dropped_connection_fails_what_was_asked_at_once_and_says_hello_again():
    scheduler_side, side, prefill = asked_old(answer_hello=True)
    try:
        prefill = restarted(prefill)
        started = time.monotonic()
        said_hello(prefill, side, NEW)
        assert side.transfers["old"].state is IncomingState.FAILED and "dropped" in side.transfers["old"].reason
        assert time.monotonic() - started < 2, "failed at once, not at the KV timeout"
        assert [(type(msg), msg.request_id) for _, msg in received(prefill, side, 1)] == [(Abort, "old")]
        ask_for(scheduler_side, "new", prefill, [2, 3])
        assert isinstance(received(prefill, side, 1)[0][1], KVWant), "the new link serves new requests"
    finally:
        side.close()
        prefill.close()


def test_no_hello_renews_the_link_resends_what_it_named_and_fails_the_rest_at_once(asked_before_restart):
    scheduler_side, side, prefill = asked_before_restart
    ask_for(scheduler_side, "new", prefill, [2, 3])  # goes on the old socket, which reconnected silently
    stale_peer, want = received(prefill, side, 1)[0]
    assert isinstance(want, KVWant) and want.request_id == "new"
    started = time.monotonic()
    prefill.send(stale_peer, Error(code="no_hello", message="say Hello first", request_id="new", incarnation=NEW))
    peer = said_hello(prefill, side, NEW)
    assert peer != stale_peer, "a new socket, not the old one"
    messages = [msg for _, msg in received(prefill, side, 2)]
    assert [(type(m), m.request_id) for m in messages] == [(KVWant, "new"), (Abort, "old")]
    old, new = side.transfers["old"], side.transfers["new"]
    assert old.state is IncomingState.FAILED and "stale" in old.reason
    assert time.monotonic() - started < 2, "failed at once, not at the KV timeout"
    assert new.state is IncomingState.RECEIVING and new.resent
    assert scheduler_side.poll().failed.keys() == {"old"}, "the scheduler recomputes the old one"


def test_a_hold_sent_to_the_old_incarnation_fails_when_it_is_asked_for(asked_before_restart):
    scheduler_side, side, prefill = asked_before_restart
    side.hold("held", prefill.address)  # queued here before the restart was known
    stale_peer, hold = received(prefill, side, 1)[0]
    assert isinstance(hold, KVHold)
    prefill.send(stale_peer, Error(code="no_hello", message="say Hello first", request_id="elsewhere", incarnation=NEW))
    said_hello(prefill, side, NEW)
    assert [type(msg) for _, msg in received(prefill, side, 1)] == [Abort], "the old transfer is aborted"
    ask_for(scheduler_side, "held", prefill, [2, 3])
    assert side.transfers["held"].state is IncomingState.FAILED and "restarted" in side.transfers["held"].reason
    assert [(type(msg), msg.request_id) for _, msg in received(prefill, side, 1)] == [(Abort, "held")]


def test_a_hold_the_new_incarnation_refused_goes_again(asked_before_restart):
    scheduler_side, side, prefill = asked_before_restart
    side.hold("held", prefill.address)
    stale_peer, _ = received(prefill, side, 1)[0]
    prefill.send(stale_peer, Error(code="no_hello", message="say Hello first", request_id="held", incarnation=NEW))
    said_hello(prefill, side, NEW)
    messages = {(type(msg), msg.request_id) for _, msg in received(prefill, side, 2)}
    assert messages == {(KVHold, "held"), (Abort, "old")}
    ask_for(scheduler_side, "held", prefill, [2, 3])
    assert side.transfers["held"].state is IncomingState.RECEIVING
    assert isinstance(received(prefill, side, 1)[0][1], KVWant)


def test_an_error_naming_no_request_is_not_ignored(asked_before_restart):
    _, side, prefill = asked_before_restart
    side.hold("probe", prefill.address)
    stale_peer, _ = received(prefill, side, 1)[0]
    prefill.send(stale_peer, Error(code="unexpected", message="what is this?"))
    said_hello(prefill, side, NEW)
    assert side.transfers["old"].state is IncomingState.FAILED


def test_the_routers_new_incarnation_renews_the_link_before_any_request():
    """The router heard of the new process first (its connection drop not seen yet: here, none at all)."""
    _, side, prefill = asked_old(answer_hello=True)
    try:
        trust = KVPeerTrust()
        side.kv_peers = trust
        side.receive()  # the router has said nothing yet: the link stays
        assert side.transfers["old"].state is IncomingState.RECEIVING
        trust.update_from_router((prefill.address,), "router", {prefill.address: NEW})
        started = time.monotonic()
        said_hello(prefill, side, NEW)
        assert side.transfers["old"].state is IncomingState.FAILED
        assert time.monotonic() - started < 2
        assert [(type(msg), msg.request_id) for _, msg in received(prefill, side, 1)] == [(Abort, "old")]
        trust.update_from_router((prefill.address,), "router", {prefill.address: NEW})
        side.receive()
        assert recv_flushing_nothing(prefill, side), "the same announcement again renews nothing"
    finally:
        side.close()
        prefill.close()


def recv_flushing_nothing(prefill: ServerSocket, side) -> bool:
    """Whether D sends nothing more (a Hello for one) within a short while."""
    try:
        recv_flushing(prefill, side, timeout_s=0.3)
    except TimeoutError:
        return True
    return False
