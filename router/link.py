"""EngineLink: the router's DEALER socket to one engine's control ROUTER, on the asyncio loop.

One reader task per link decodes what the engine sends and routes each TokenDelta by request id to
the asyncio.Queue of the request waiting for it. Sends never wait: a message the engine cannot take
right now (not connected, or its queue is full) raises EngineUnreachable at once, so a request can
go elsewhere instead of hanging on a dead peer. A socket monitor marks the link broken the moment its
connection drops (the engine process died), so the registry need not wait for missed heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.control.errors import ProtocolError, WireError
from pdserve.control.keys import CurveClientConfig
from pdserve.control.messages import EngineStats, Error, Register, StatsRequest, TokenDelta
from pdserve.control.protocol import decode, encode
from pdserve.control.schema import Message
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, open_socket

log = logging.getLogger("pdserve.router.link")

LINK_HWM = 100_000  # messages queued per link; beyond it the engine is treated as unreachable
DRAIN_LIMIT = 256  # messages read per wake-up of a link's reader, so other tasks get their turn


class EngineUnreachable(Exception):
    """A message could not be handed to an engine's socket."""


@dataclass(frozen=True)
class EngineGone:
    """Put in a request's queue when its engine left routing (missed heartbeats, deregistered, closed)."""

    engine_id: str
    reason: str


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
        self.pending_tokens = 0  # prompt tokens sent since the last stats (load not yet reported)
        self.streams: dict[str, asyncio.Queue] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._opened = open_socket(zmq.DEALER, control_address, bind=False, curve=curve, context=context,
                                   hwm=LINK_HWM, linger_s=0, max_message_bytes=CONTROL_MESSAGE_BYTES)
        self.socket: zmq.asyncio.Socket = self._opened.socket
        self.broken: str | None = None  # why the connection dropped, until the registry acts on it
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._reader = asyncio.create_task(self._read_loop(), name=f"link {control_address}")
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
            self.socket.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False).result()
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

    def open_stream(self, request_id: str, queue: asyncio.Queue) -> None:
        self.streams[request_id] = queue
        self.num_inflight += 1

    def close_stream(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:
            self.num_inflight -= 1

    def fail_streams(self, reason: str) -> None:
        gone = EngineGone(self.engine_id, reason)
        for queue in self.streams.values():
            queue.put_nowait(gone)

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
        self.pending_tokens = 0
        self.last_seen = time.monotonic()
        for future in self._stats_waiters:
            if not future.done():
                future.set_result(stats)
        self._stats_waiters.clear()

    # ---- receiving ----

    async def _read_loop(self) -> None:
        """Wait for a message, then take every message already queued without waiting again (one wake-up
        of this task per burst, not one asyncio future per message)."""
        drain = zmq.Socket.shadow(self.socket.underlying)  # the same socket, read synchronously
        while True:
            self._receive(await self.socket.recv_multipart(copy=False))
            for _ in range(DRAIN_LIMIT):
                try:
                    parts = drain.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._receive(parts)

    def _receive(self, parts: list) -> None:
        try:
            msg, _ = decode(parts)
        except ProtocolError as exc:
            log.warning("engine %s sent a bad message: %s", self.engine_id, exc)
            return
        self.last_seen = time.monotonic()
        self.num_received += 1
        self._dispatch(msg)

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.broken = f"the link to engine {self.engine_id} at {self.control_address} broke"

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, TokenDelta):
            queue = self.streams.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)
        elif isinstance(msg, EngineStats):
            self.set_stats(msg)
        elif isinstance(msg, Register):
            self.info = msg
        elif isinstance(msg, Error):
            self._on_error(msg)

    def _on_error(self, msg: Error) -> None:
        log.warning("engine %s answered with an error (%s): %s", self.engine_id, msg.code, msg.message)
        queue = self.streams.get(msg.request_id) if msg.request_id else None
        if queue is not None:
            code = "invalid_request" if msg.code == "invalid_request" else "internal_error"
            queue.put_nowait(TokenDelta(request_id=msg.request_id, finish_reason="error", error=msg.message,
                                        error_code=code))

    async def close(self) -> None:
        """Stop the link's tasks and close its sockets. The sockets close even when the caller is
        cancelled meanwhile, and that cancellation goes on up (the registry's close waits for it)."""
        self.up = False
        self._reader.cancel()
        self._watcher.cancel()
        try:
            await asyncio.gather(self._reader, self._watcher, return_exceptions=True)
        finally:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._opened.close(linger_s=0)
