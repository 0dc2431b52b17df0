"""EngineLink: the router's DEALER socket to one engine's control ROUTER, on the asyncio loop.

A reader callback on the socket's file descriptor (not a task awaiting pyzmq's asyncio futures: that
machinery cost more router CPU per streamed token than decoding it, docs/results.md, router overhead) decodes
what the engine sends and routes each TokenDelta (and a prompt's PromptLogprobs, read into a
PromptLogprobsChunk) by request id to the request waiting for it (the sink given to open_stream).
Sends never wait: a message the engine cannot take right now (not connected, or its queue is full)
raises EngineUnreachable at once, so a request can go elsewhere instead of hanging on a dead peer. A socket
monitor marks the link broken the moment its connection drops (the engine process died), so the registry
need not wait for missed heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.control.errors import ProtocolError, WireError
from pdserve.control.keys import CurveClientConfig
from pdserve.control.messages import EngineStats, Error, PromptLogprobs, Register, StatsRequest, TokenDelta
from pdserve.control.prompt_logprobs import PositionLogprobs, read
from pdserve.control.protocol import decode, encode
from pdserve.control.schema import Message
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, open_socket

log = logging.getLogger("pdserve.router.link")

LINK_HWM = 100_000  # messages queued per link; beyond it the engine is treated as unreachable
DRAIN_LIMIT = 256  # messages read per call of a link's reader, so other callbacks get their turn
# plain ints: pyzmq's constants are enums, and `int & enum` builds a new enum member (Python calls) on
# every check of the reader, which runs once per streamed token
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class StreamSink(Protocol):
    """Where a request's messages from this engine go (the router's per-attempt sink, or a test's queue)."""

    def put_nowait(self, item: Any) -> None: ...


class EngineUnreachable(Exception):
    """A message could not be handed to an engine's socket."""


@dataclass(frozen=True)
class EngineGone:
    """Put in a request's sink when its engine left routing (missed heartbeats, deregistered, closed)."""

    engine_id: str
    reason: str


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """Put in a request's sink for each PromptLogprobs its engine sends (before its first token): the
    message and its positions, read out of the payload frames (control/prompt_logprobs.py)."""

    msg: PromptLogprobs
    rows: list[PositionLogprobs]  # one {token id: (logprob, rank)} per position, from msg.start on


class EngineLink:
    def __init__(self, control_address: str, context: zmq.asyncio.Context, *, static: bool = False,
                 curve: CurveClientConfig | None = None) -> None:
        self.control_address = control_address
        self.static = static  # given on the command line (polled), not registered
        self.info: Register | None = None  # what the engine said about itself
        self.stats: EngineStats | None = None
        self.label = control_address  # metric label; the registry sets the engine id
        self.up = False  # routable: the link answered and heartbeats are on time
        self.last_seen = time.monotonic()
        self.num_received = 0  # messages that came back over this link: > 0 means it works
        self.num_inflight = 0  # requests the router has open on this engine
        self.owner: bytes | None = None  # the registration connection that registered it: only it may change it
        self.owner_heard = 0.0  # when that connection last sent something
        self.streams: dict[str, StreamSink] = {}
        # the router's own ledger of what it has open on this engine: per request, the tokens sent (the prompt
        # or its uncached part) plus those that came back; `open_tokens` is their sum (router.policies)
        self.stream_tokens: dict[str, int] = {}
        self.open_tokens = 0
        # of those, the prompts it computes and has not answered yet (request id -> uncached tokens), their sum and
        # the sum of their squares; and the streams that only prefill here (a prefill engine's part)
        self.prefilling: dict[str, int] = {}
        self.queued_prefill_tokens = 0
        self.queued_prefill_squares = 0
        self.prefill_only: dict[str, int] = {}  # request id -> tokens counted in open_tokens
        self.prefill_only_tokens = 0
        self._stats_waiters: list[asyncio.Future] = []
        # a plain (synchronous) socket on the registry's context: sends never wait, and reading is the
        # loop's reader callback on its file descriptor
        self._opened = open_socket(zmq.DEALER, control_address, bind=False, curve=curve,
                                   context=zmq.Context.shadow(context.underlying),
                                   hwm=LINK_HWM, linger_s=0, max_message_bytes=CONTROL_MESSAGE_BYTES)
        self.socket: zmq.Socket = self._opened.socket
        self.broken: str | None = None  # why the connection dropped, until the registry acts on it
        self._loop = asyncio.get_running_loop()
        self._read_scheduled = False
        self._loop.add_reader(self.socket.FD, self._read)
        self._schedule_read()  # anything that came before the reader was added
        self._monitor = self._open_monitor(context)
        self._watcher = asyncio.create_task(self._watch_connection(), name=f"link monitor {control_address}")

    @property
    def engine_id(self) -> str:
        return self.info.engine_id if self.info else self.control_address

    @property
    def role(self) -> str | None:
        return self.info.role if self.info else None

    # ---- sending ----

    def send(self, msg: Message) -> None:
        """Hand msg to the socket now or raise EngineUnreachable."""
        try:
            self.socket.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
            self._schedule_read()  # a send may take the descriptor's wake-up for a message that came meanwhile
        except zmq.Again:
            raise EngineUnreachable(f"engine {self.engine_id} at {self.control_address} is not connected "
                                    f"or not taking messages") from None
        except (zmq.ZMQError, WireError) as exc:
            raise EngineUnreachable(f"send to engine {self.engine_id} failed: {exc}") from exc

    def try_send(self, msg: Message) -> bool:
        try:
            self.send(msg)
            return True
        except EngineUnreachable as exc:
            log.debug("%s", exc)
            return False

    # ---- streams ----

    def open_stream(self, request_id: str, sink: StreamSink, num_tokens: int = 0, *, num_prefill_tokens: int = 0,
                    decodes: bool = True) -> None:
        """Deltas of request_id go to sink until close_stream; num_tokens: the prompt tokens it puts on this engine
        (the load the policies read, grown by every token that comes back); num_prefill_tokens: those the engine
        computes itself (queued until the request's first token); decodes: False for a prefill engine's part."""
        self.streams[request_id] = sink
        self.stream_tokens[request_id] = num_tokens
        self.open_tokens += num_tokens
        self.num_inflight += 1
        if num_prefill_tokens > 0:
            self.prefilling[request_id] = num_prefill_tokens
            self.queued_prefill_tokens += num_prefill_tokens
            self.queued_prefill_squares += num_prefill_tokens * num_prefill_tokens
        if not decodes:
            self.prefill_only[request_id] = num_tokens
            self.prefill_only_tokens += num_tokens

    def close_stream(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:
            self.open_tokens -= self.stream_tokens.pop(request_id)
            self.num_inflight -= 1
            self._prefilled(request_id)
            self.prefill_only_tokens -= self.prefill_only.pop(request_id, 0)

    def _prefilled(self, request_id: str) -> None:
        num_tokens = self.prefilling.pop(request_id, 0)
        self.queued_prefill_tokens -= num_tokens
        self.queued_prefill_squares -= num_tokens * num_tokens

    @property
    def num_decoding(self) -> int:
        """Requests open on this engine that it decodes (or will, once prefilled)."""
        return self.num_inflight - len(self.prefill_only)

    @property
    def decode_tokens(self) -> int:
        """The tokens of those requests (the ledger's open_tokens less the prefill-only streams')."""
        return self.open_tokens - self.prefill_only_tokens

    def fail_streams(self, reason: str) -> None:
        gone = EngineGone(self.engine_id, reason)
        for sink in self.streams.values():
            sink.put_nowait(gone)

    # ---- stats ----

    async def fresh_stats(self, timeout: float) -> EngineStats | None:
        """Ask the engine for its stats now; the previous ones if it does not answer in time."""
        future = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(future)
        try:
            if self.try_send_stats_request():
                return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if future in self._stats_waiters:
                self._stats_waiters.remove(future)
        return self.stats

    def try_send_stats_request(self) -> bool:
        return self.try_send(StatsRequest())

    def set_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        self.last_seen = time.monotonic()
        for future in self._stats_waiters:
            if not future.done():
                future.set_result(stats)
        self._stats_waiters.clear()

    # ---- receiving ----

    def _schedule_read(self) -> None:
        if not self._read_scheduled:
            self._read_scheduled = True
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        """Take every queued message (at most DRAIN_LIMIT, then continue in a later callback). ZeroMQ's
        descriptor signals edges, not levels: it wakes the loop again only once the queue has been emptied."""
        self._read_scheduled = False
        for _ in range(DRAIN_LIMIT):
            try:
                if not self.socket.getsockopt(_EVENTS) & _POLLIN:
                    return
                parts = self.socket.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # the socket was closed under the reader
                log.debug("link %s stopped reading: %s", self.control_address, exc)
                return
            try:
                self._receive(parts)
            except Exception:  # noqa: BLE001 - one bad message must not stop the reading (no later edge would come)
                log.exception("link %s: handling a message failed", self.control_address)
        self._schedule_read()

    def _receive(self, parts: list) -> None:
        try:
            msg, frames = decode(parts)
        except ProtocolError as exc:
            log.warning("engine %s sent a bad message: %s", self.engine_id, exc)
            return
        self.last_seen = time.monotonic()
        self.num_received += 1
        self._dispatch(msg, frames)

    def _open_monitor(self, context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        """An asyncio PAIR socket that hears when the link's connection drops."""
        address = f"inproc://pdserve-link-monitor-{id(self)}"
        self.socket.monitor(address, zmq.EVENT_DISCONNECTED)
        monitor = context.socket(zmq.PAIR)
        monitor.connect(address)
        return monitor

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.broken = f"the link to engine {self.engine_id} at {self.control_address} broke"
                self.fail_streams(self.broken)  # its requests move now; the registry takes it out of routing next

    def _dispatch(self, msg: Message, frames: list[memoryview]) -> None:
        if isinstance(msg, TokenDelta):  # per streamed token: keep this branch first and lean (issue #17)
            sink = self.streams.get(msg.request_id)
            if sink is not None:
                if msg.token_ids:
                    self.stream_tokens[msg.request_id] += len(msg.token_ids)
                    self.open_tokens += len(msg.token_ids)
                    if self.prefilling:
                        self._prefilled(msg.request_id)
                sink.put_nowait(msg)
        elif isinstance(msg, PromptLogprobs):
            sink = self.streams.get(msg.request_id)
            if sink is not None:  # read only for a request still waiting (frames verified by decode)
                sink.put_nowait(PromptLogprobsChunk(msg, read(msg, frames)))
        elif isinstance(msg, EngineStats):
            self.set_stats(msg)
        elif isinstance(msg, Register):
            self.info = msg
        elif isinstance(msg, Error):
            self._on_error(msg)

    def _on_error(self, msg: Error) -> None:
        log.warning("engine %s answered with an error (%s): %s", self.engine_id, msg.code, msg.message)
        sink = self.streams.get(msg.request_id) if msg.request_id else None
        if sink is not None:
            code = "invalid_request" if msg.code == "invalid_request" else "internal_error"
            sink.put_nowait(TokenDelta(request_id=msg.request_id, finish_reason="error", error=msg.message,
                                        error_code=code))

    async def close(self) -> None:
        """Stop the link's tasks and close its sockets. The sockets close even when the caller is
        cancelled meanwhile, and that cancellation goes on up (the registry's close waits for it)."""
        self.up = False
        self._loop.remove_reader(self.socket.FD)
        self._watcher.cancel()
        try:
            await asyncio.gather(self._watcher, return_exceptions=True)
        finally:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._opened.close(linger_s=0)
