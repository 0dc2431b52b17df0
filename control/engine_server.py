"""The loop every engine process runs: control messages in, engine steps, token deltas out.

One thread: wait on the control socket and the KV connector's sockets (not at all while the engine
has runnable work), handle what arrived, step the engine once, publish what the step produced.
The prefill and decode services subclass it with their request types; registration with a router
runs beside it (control.heartbeat). Each round of the loop is its progress: it may touch a progress
file a supervisor watches (`pdserve up`), and it feeds the heartbeat, which goes quiet when it stalls.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import time
from typing import Any

import zmq

from pdserve.control.errors import InvalidRequestError, PeerUnreachableError, ProtocolError, WireError
from pdserve.control.gc_freeze import freeze_startup_heap
from pdserve.control.admission import EXIT_NOT_ADMITTED, AdmissionWatch, NotAdmitted
from pdserve.control.heartbeat import Heartbeat, advertised_address
from pdserve.control.keys import ClusterCurve
from pdserve.control.messages import (
    Abort,
    DescribeRequest,
    EngineStats,
    Error,
    Register,
    StatsRequest,
    TokenDelta,
    new_incarnation,
)
from pdserve.control.prompt_logprobs import pack as pack_prompt_logprobs
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, ServerSocket

log = logging.getLogger("pdserve.engine_server")

IDLE_WAIT_MS = 20  # longest wait for input while nothing can run (bounds timeout checks, too)
CONTROL_MESSAGES_PER_ITERATION = 256  # a flood of control messages cannot keep the loop from stepping
# Replies queued per control peer before more are dropped: far above what a reading router lets pile up,
# and a bound on what a peer that never reads can cost.
CONTROL_REPLY_HWM = 100_000
PROGRESS_MARK_S = 0.5  # the loop touches its progress file at most this often


def _invalid_request(exc: Exception, request_id: str | None) -> TokenDelta | Error:
    """A request the engine refuses is the client's fault: its stream ends with error_code
    "invalid_request" (the router's 400)."""
    if request_id:
        return TokenDelta(request_id=request_id, finish_reason="error", error=str(exc), error_code="invalid_request")
    return Error(code="invalid_request", message=str(exc))


def let_zmq_send() -> None:
    """Give this core to a runnable thread, the ZeroMQ I/O thread above all, before the next step.

    A step's sends only queue each message for zmq's I/O thread, which writes it to the peer. That thread
    shares the engine's core when the engine is pinned to one (`--pin-cpus`), and a loop with runnable work
    never blocks, so the thread waited for the kernel's next tick: 4 ms on a HZ=250 kernel, in 4-6% of first
    tokens (docs/results.md, "Router overhead"). One syscall a step; with nothing else runnable on the
    core it returns at once."""
    os.sched_yield()


def _poll_these(poller: zmq.Poller, registered: set, sockets: list) -> None:
    """The poller watches exactly `sockets`: new ones (a decode engine's new KV link) are added, and ones that are
    gone (a link dropped and closed) removed; a closed socket left in it made every poll return at once, and the
    loop spun a core while idle (an outside probe)."""
    for socket in registered - set(sockets):
        poller.unregister(socket)
        registered.discard(socket)
    for socket in sockets:
        if socket not in registered:
            poller.register(socket, zmq.POLLIN)
            registered.add(socket)


def _refusal(exc: ProtocolError) -> TokenDelta | Error:
    """The answer to a control message that did not decode: a request refused for its values (e.g.
    sampling out of range) like any invalid request, anything else as a protocol error."""
    if isinstance(exc, InvalidRequestError):
        return _invalid_request(exc, exc.request_id)
    return Error.from_exception(exc)


class EngineServer:
    role = ""

    def __init__(self, engine: Any, kv_transfer: Any, control_address: str, engine_id: str,
                 curve: ClusterCurve | None = None, incarnation: str | None = None) -> None:
        self.engine = engine  # engine.engine_core.EngineCore
        self.kv_transfer = kv_transfer  # the KV connector's transfer side (engine.kv_connector.KVTransferSide)
        self.engine_id = engine_id
        self.incarnation = incarnation or new_incarnation()  # this process's, in its registration and KV link
        self.curve = curve  # CURVE keys of the cluster: every link encrypted and authenticated
        self.control = ServerSocket(control_address, curve=curve.server if curve else None, hwm=CONTROL_REPLY_HWM,
                                    max_message_bytes=CONTROL_MESSAGE_BYTES)
        self.owners: dict[str, bytes] = {}  # request id -> control peer that sent it
        # set by stop(), which also runs as the SIGTERM/SIGINT handler: a plain attribute, as a handler must take no
        # lock (a second signal handled inside the first's Event.set would wait on that Event's lock forever)
        self.stopping = False
        self.heartbeats: list[Heartbeat] = []  # one per router this engine registers with
        self.admissions: list[AdmissionWatch] = []  # one per router: did it admit this engine?
        self._contacted = False  # a router reached this engine (control socket or registration link)
        self.advertise_host: str | None = None
        self.progress_file: str | None = None
        self._progress_marked = 0.0

    @property
    def control_address(self) -> str:
        return self.control.address

    def stop(self, *_: Any) -> None:
        """Leave the loop at its next turn (any thread, or a signal handler: any number of times)."""
        self.stopping = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def run(self) -> None:
        freeze_startup_heap()  # torch, transformers, the model: no full collection walks them mid-step
        poller = zmq.Poller()
        registered: set = set()
        try:
            while not self.stopping:
                _poll_these(poller, registered, [self.control.socket, *self.kv_transfer.sockets()])
                poller.poll(0 if self.engine.has_runnable_work() else IDLE_WAIT_MS)
                self._guarded(self._drain_control)
                self._guarded(self.kv_transfer.receive)
                if self.engine.has_work():
                    self.publish(self.engine.step())
                    let_zmq_send()
                if any(heartbeat.wants_stats() for heartbeat in self.heartbeats):
                    stats = self.stats()
                    for heartbeat in self.heartbeats:
                        heartbeat.set_stats(stats)
                self._check_admission()
                self._mark_progress()
        except NotAdmitted as exc:
            log.error("%s", exc)
            raise SystemExit(EXIT_NOT_ADMITTED) from None
        finally:
            self.close()

    def _check_admission(self) -> None:
        for watch in self.admissions:
            watch.admitted = watch.admitted or self._contacted
            watch.check()

    def enable_progress_file(self, path: str) -> None:
        """Touch `path` as the loop goes round (at most every PROGRESS_MARK_S): its mtime is the loop's
        last progress, read by a supervisor; a loop stuck in a step leaves it old."""
        with open(path, "a"):
            pass
        self.progress_file = path

    def _mark_progress(self) -> None:
        now = time.monotonic()
        if self.progress_file is None or now - self._progress_marked < PROGRESS_MARK_S:
            return
        self._progress_marked = now
        try:
            os.utime(self.progress_file)
        except OSError as exc:  # the supervisor's business; serving goes on
            log.warning("cannot touch the progress file %s: %s", self.progress_file, exc)
            self.progress_file = None

    @staticmethod
    def _guarded(handler) -> None:
        """Input handling must never take the engine down: log the bug and keep serving."""
        try:
            handler()
        except Exception:  # noqa: BLE001 - deliberately broad, see above
            log.exception("error while handling input; the engine keeps serving")

    def close(self) -> None:
        for heartbeat in self.heartbeats:
            heartbeat.stop()
        for watch in self.admissions:
            watch.close()
        self.kv_transfer.close()
        self.control.close()

    # ---- control plane ----

    def _drain_control(self) -> None:
        for routed in self.control.drain(_refusal, limit=CONTROL_MESSAGES_PER_ITERATION):
            self._contacted = True  # only an authenticated peer gets a message through
            try:
                self.handle(routed.peer_id, routed.msg)
            except ValueError as exc:  # InvalidRequestError and friends: the client's fault, named
                self.reply(routed.peer_id, _invalid_request(exc, getattr(routed.msg, "request_id", None)))

    def handle(self, peer_id: bytes, msg: Any) -> None:
        if isinstance(msg, Abort):
            self.engine.abort(msg.request_id)
        elif isinstance(msg, StatsRequest):
            self.reply(peer_id, self.stats())
        elif isinstance(msg, DescribeRequest):
            self.reply(peer_id, self.registration())
        else:
            self.reply(peer_id, Error(code="unexpected", message=f"{msg.type_name} is not served by a {self.role} engine"))

    def publish(self, deltas: list[TokenDelta]) -> None:
        """Send each delta of a step, as the scheduler made it, to the peer that sent its request. A
        request whose peer is gone (a router that died: its connection closed) is aborted, so its blocks
        go back now rather than after max_tokens nobody reads. Prompt logprobs go first: a request's
        come before its first token."""
        self._publish_prompt_logprobs()
        for delta in deltas:
            owner = self.owners.get(delta.request_id)
            if delta.finish_reason is not None:
                self.owners.pop(delta.request_id, None)
            message = self.outgoing(delta) if owner is not None else None
            if message is not None and not self._deliver(owner, message):
                self._abort_orphan(delta)

    def _publish_prompt_logprobs(self) -> None:
        for request_id, tables in self.engine.take_prompt_logprobs():
            owner = self.owners.get(request_id)
            if owner is None:  # its router is gone: the request is being aborted
                continue
            for msg, buffers in pack_prompt_logprobs(request_id, *tables):
                self._deliver(owner, msg, *buffers)

    def _deliver(self, peer_id: bytes, msg: Any, *buffers: Any) -> bool:
        """Send without waiting; False only when the peer is gone (a full queue drops the message, logged)."""
        try:
            self.control.send(peer_id, msg, *buffers, timeout=0)
        except PeerUnreachableError:
            return False
        except WireError as exc:
            log.info("could not send %s to peer %s: %s", msg.type_name, peer_id.hex(), exc)
        return True

    def _abort_orphan(self, delta: TokenDelta) -> None:
        self.owners.pop(delta.request_id, None)
        if delta.finish_reason is None:
            self.engine.abort(delta.request_id)
            log.warning("request %s aborted: the router that sent it is gone", delta.request_id)

    def outgoing(self, delta: TokenDelta) -> TokenDelta | None:
        """What the request's peer is sent for `delta` (None: nothing): the delta as it is, by default."""
        return delta

    def reply(self, peer_id: bytes | None, msg: Any) -> None:
        """Never waits: a reply a peer's full queue cannot take is dropped (and logged), so a peer that
        does not read cannot stall the engine loop."""
        self.control.answer(peer_id, msg, timeout=0)

    def stats(self) -> EngineStats:
        """The engine's figures and its KV connector's, as they are (their fields are EngineStats')."""
        return EngineStats(engine_id=self.engine_id, role=self.role, **dataclasses.asdict(self.engine.stats()),
                           **dataclasses.asdict(self.kv_transfer.stats))

    # ---- registration with a router ----

    def enable_registration(self, router_addresses: str | list[str], interval_s: float = 1.0,
                            advertise_host: str | None = None, stall_s: float | None = None) -> None:
        """Register with every router in `router_addresses` (replicas serving the same engines) and
        heartbeat to each every interval_s seconds, until the loop makes no progress for stall_s seconds
        (None: heartbeat while the process lives). Each router is told this engine's addresses as seen
        from its side (heartbeat.advertised_address); advertise_host overrides the host in them.
        ValueError before any beat when an address could not be reached from a router."""
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval {interval_s} must be > 0 seconds")
        if stall_s is not None and not stall_s > 0:
            raise ValueError(f"stall timeout {stall_s} must be > 0 seconds (or none)")
        routers = [router_addresses] if isinstance(router_addresses, str) else list(dict.fromkeys(router_addresses))
        self.advertise_host = advertise_host
        registrations = [self.registration(router, interval_s) for router in routers]  # may raise: nothing started
        stats = self.stats()
        for router, register in zip(routers, registrations):
            heartbeat = Heartbeat(router, interval_s, self.curve.client if self.curve else None, stall_s)
            heartbeat.register = register
            heartbeat.on_message = functools.partial(self._on_registration_link, router=router)
            heartbeat.set_stats(stats)
            self.heartbeats.append(heartbeat)
            self.admissions.append(AdmissionWatch(router, heartbeat.socket, register.control_address,
                                                  secured=self.curve is not None))
        for heartbeat in self.heartbeats:
            heartbeat.start()

    def _on_registration_link(self, msg: Any, router: str = "") -> None:
        self._contacted = True
        self.on_router_message(msg, router=router)

    def on_router_message(self, msg: Any, router: str = "") -> None:
        """What a router sends on its registration link (on that heartbeat's thread): nothing, by default."""
        log.debug("ignored %s from the registration link of %s", msg.type_name, router)

    def registration(self, router: str | None = None, interval_s: float | None = None) -> Register:
        """This engine as `router` (a router address; None: whoever asked) should reach it."""
        if interval_s is None:
            interval_s = self.heartbeats[0].interval_s if self.heartbeats else 1.0
        kv_address = getattr(self, "kv_address", None)
        config = self.engine.model_config
        return Register(
            engine_id=self.engine_id, role=self.role,
            control_address=advertised_address(self.control_address, self.advertise_host, router),
            kv_address=advertised_address(kv_address, self.advertise_host, router) if kv_address else None,
            block_size=self.engine.cache_config.block_size, max_model_len=config.max_model_len,
            vocab_size=config.vocab_size, heartbeat_interval_s=interval_s, incarnation=self.incarnation)
