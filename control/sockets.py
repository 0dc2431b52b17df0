"""The one socket factory of pdserve: every ZeroMQ socket of every plane (engine control, KV link,
router registration and links, heartbeats) is made by `open_socket`, which sets its options and CURVE
and binds or connects it. `ServerSocket` (bound ROUTER) and `ClientSocket` (connected DEALER) add
bounded sync send/recv; the router uses the factory's asyncio sockets directly.
Why these socket types and bounds: docs/design/wire-protocol.md."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pdserve.control.errors import PeerUnreachableError, ProtocolError, TransportError, TransportTimeout, WireError
from pdserve.control.keys import CurveClientConfig, CurveServerConfig, require_curve
from pdserve.control.messages import Error
from pdserve.control.protocol import decode, encode
from pdserve.control.schema import MAX_FRAME_BYTES, MAX_HEADER_BYTES, Message

log = logging.getLogger("pdserve.sockets")

DEFAULT_HWM = 1000  # messages queued per peer before send waits
DEFAULT_LINGER_S = 1.0  # how long close() may keep flushing queued messages
DEFAULT_SEND_TIMEOUT_S = 10.0
# Largest frame a socket that carries no KV payload accepts: one message header and a little more.
CONTROL_MESSAGE_BYTES = MAX_HEADER_BYTES + 4096
MAX_IPC_PATH_BYTES = 107  # sun_path on Linux, minus the terminating NUL


def validate_address(address: str, *, bind: bool) -> str:
    """Check a tcp:// or ipc:// address; on bind, port 0 or * becomes zmq's "any free port"."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):
        raise TransportError(f"address {address!r} must start with tcp:// or ipc:// "
                             f"(e.g. tcp://127.0.0.1:5600 or ipc:///tmp/pdserve-kv.sock)")
    if scheme == "ipc":
        if not rest or len(rest.encode()) > MAX_IPC_PATH_BYTES:
            raise TransportError(f"ipc path {rest!r} must be 1..{MAX_IPC_PATH_BYTES} bytes: use a shorter path")
        return address
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise TransportError(f"tcp address {address!r} needs host:port, e.g. tcp://127.0.0.1:5600")
    if port in ("*", "0"):
        if not bind:
            raise TransportError(f"cannot connect to {address!r}: give the port the server is bound to")
        return f"tcp://{host}:*"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise TransportError(f"tcp address {address!r} has port {port!r}: use 1..65535 (or 0 / * to bind any)")
    return address


class _AllowList:
    """ZAP credentials provider: admits the listed client public keys (Z85)."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class OpenSocket:
    """A socket from the factory, with what closing it takes (its ZAP handler and own context, if any).

    `socket` is a zmq.Socket, or a zmq.asyncio.Socket when the context is asyncio; `address` is the
    bound endpoint (the real port when port 0 was asked for) or the address connected to."""

    def __init__(self, socket: Any, address: str, context: zmq.Context | None,
                 authenticator: ThreadAuthenticator | None) -> None:
        self.socket, self.address = socket, address
        self._own_context, self._authenticator = context, authenticator

    def close(self, linger_s: float | None = None) -> None:
        self.socket.close(linger=None if linger_s is None else math.ceil(linger_s * 1000))
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._own_context is not None:
            self._own_context.term()


def open_socket(kind: int, address: str, *, bind: bool, curve: CurveServerConfig | CurveClientConfig | None = None,
                context: zmq.Context | None = None, hwm: int = DEFAULT_HWM,
                linger_s: float = DEFAULT_LINGER_S, max_message_bytes: int = MAX_FRAME_BYTES) -> OpenSocket:
    """A ROUTER (bind=True) or DEALER (bind=False) with pdserve's options, CURVE and bind/connect done.

    Every socket: bounded linger and queues, ZMQ_MAXMSGSIZE = max_message_bytes (a peer that sends a
    larger frame is disconnected before it is buffered; sockets without KV payloads pass
    CONTROL_MESSAGE_BYTES). ROUTER: ROUTER_MANDATORY (a send to a gone peer raises). DEALER: IMMEDIATE
    (nothing queues before a connection, CURVE handshake included, succeeds). A server whose CURVE
    config lists allowed client keys gets a context of its own with a ZAP handler (one per context)."""
    endpoint = validate_address(address, bind=bind)
    context = context or zmq.Context.instance()
    own_context = authenticator = None
    if isinstance(curve, CurveServerConfig) and curve.allowed_client_keys is not None:
        require_curve()
        own_context = context = type(context)()  # asyncio or sync, as asked
        authenticator = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
        authenticator.start()
        authenticator.configure_curve_callback("*", _AllowList(curve.allowed_client_keys))
    socket = context.socket(kind)
    opened = OpenSocket(socket, address, own_context, authenticator)
    try:
        _set_options(socket, kind, hwm, linger_s, max_message_bytes)
        _set_curve(socket, curve)
        if bind:
            socket.bind(endpoint)
            opened.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        opened.close(linger_s=0)
        verb, fix = ("bind", ": pick a free port / writable ipc path") if bind else ("connect to", "")
        raise TransportError(f"cannot {verb} {address}: {exc}{fix}") from exc
    return opened


def _set_options(socket: zmq.Socket, kind: int, hwm: int, linger_s: float, max_message_bytes: int) -> None:
    socket.setsockopt(zmq.LINGER, _timeout_ms(linger_s))
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if kind == zmq.ROUTER:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    elif kind == zmq.DEALER:
        socket.setsockopt(zmq.IMMEDIATE, 1)


def _set_curve(socket: zmq.Socket, curve: CurveServerConfig | CurveClientConfig | None) -> None:
    if curve is None:
        return
    require_curve()
    socket.curve_secretkey = curve.keypair.secret_key
    socket.curve_publickey = curve.keypair.public_key
    if isinstance(curve, CurveServerConfig):
        socket.curve_server = True
    else:
        socket.curve_serverkey = curve.server_public_key


# ---- sync sockets with bounded waits ----

class Received(NamedTuple):
    msg: Message
    frames: list[memoryview]


class Routed(NamedTuple):
    peer_id: bytes
    msg: Message
    frames: list[memoryview]


def _timeout_ms(timeout: float) -> int:
    if timeout is None or not timeout >= 0:
        raise ValueError(f"timeout={timeout!r}: pass a wait bound in seconds (>= 0; 0 polls)")
    return math.ceil(timeout * 1000)


class _SyncSocket:
    """Bounded send/recv and close shared by ServerSocket and ClientSocket. recv(timeout) returns None
    when nothing arrives in time; send raises TransportTimeout when no peer takes the message in time.
    Payload buffers are sent without copying: keep them unchanged until the peer has them."""

    def __init__(self, kind: int, address: str, *, bind: bool, curve: Any, context: zmq.Context | None,
                 hwm: int, linger: float, send_timeout: float, max_message_bytes: int) -> None:
        self._opened = open_socket(kind, address, bind=bind, curve=curve, context=context, hwm=hwm, linger_s=linger,
                                   max_message_bytes=max_message_bytes)
        self._socket = self._opened.socket
        self.address = self._opened.address
        self._send_timeout = send_timeout
        self._sndtimeo = self._rcvtimeo = -2  # unset; -1 would mean "forever"
        self.closed = False

    def _send_parts(self, parts: list[Any], timeout: float | None, peer_id: bytes | None = None) -> None:
        """Send one multipart message; errors name the peer (peer_id on a ROUTER, the address otherwise)."""
        ms = _timeout_ms(self._send_timeout if timeout is None else timeout)
        if ms != self._sndtimeo:
            self._socket.setsockopt(zmq.SNDTIMEO, ms)
            self._sndtimeo = ms
        try:
            self._socket.send_multipart(parts, copy=False)
        except zmq.Again:
            raise TransportTimeout(f"no peer took the message to {self._peer_name(peer_id)} within {ms} ms: check "
                                   f"that the peer is up, reachable and (with CURVE) holds the right keys") from None
        except zmq.ZMQError as exc:
            where = self._peer_name(peer_id)
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachableError(f"{where} is not connected (it left or never said Hello)") from None
            raise TransportError(f"send to {where} failed: {exc}") from exc

    def _peer_name(self, peer_id: bytes | None) -> str:
        return f"peer {peer_id.hex()}" if peer_id is not None else self.address

    def _recv_parts(self, timeout: float) -> list[zmq.Frame] | None:
        ms = _timeout_ms(timeout)
        if ms != self._rcvtimeo:  # a socket option, not a poll per call: cheaper per message
            self._socket.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        try:
            return self._socket.recv_multipart(copy=False)
        except zmq.Again:
            return None

    @property
    def socket(self) -> zmq.Socket:
        """The underlying socket, for a zmq.Poller that waits on several sockets at once."""
        return self._socket

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._opened.close()

    def __enter__(self) -> _SyncSocket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ServerSocket(_SyncSocket):
    """ROUTER bound at `address` (tcp://host:port, port 0 picks a free one; or ipc://path); answers
    each peer by its routing id."""

    def __init__(self, address: str, *, curve: CurveServerConfig | None = None, hwm: int = DEFAULT_HWM,
                 linger: float = DEFAULT_LINGER_S, send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
                 context: zmq.Context | None = None, max_message_bytes: int = MAX_FRAME_BYTES):
        super().__init__(zmq.ROUTER, address, bind=True, curve=curve, context=context, hwm=hwm, linger=linger,
                         send_timeout=send_timeout, max_message_bytes=max_message_bytes)

    def send(self, peer_id: bytes, msg: Message, *buffers: Any, timeout: float | None = None) -> None:
        """Send msg (+ payload buffers, not copied) to one connected peer."""
        self._send_parts([peer_id, *encode(msg, *buffers)], timeout, peer_id)

    def recv(self, timeout: float) -> Routed | None:
        """Next message within `timeout` seconds, or None. A malformed message raises ProtocolError
        with `peer_id` set, so the caller can answer it with Error.from_exception(exc)."""
        parts = self._recv_parts(timeout)
        if parts is None:
            return None
        peer_id = parts[0].bytes
        try:
            msg, frames = decode(parts[1:])
        except ProtocolError as exc:
            exc.peer_id = peer_id
            raise
        return Routed(peer_id, msg, frames)

    def drain(self, refusal: Callable[[ProtocolError], Message] = Error.from_exception,
              limit: int | None = None) -> Iterator[Routed]:
        """The messages waiting now, at most `limit` of them (a flooding peer cannot keep the caller's
        loop reading). A malformed one is logged, answered with `refusal(exc)` (an Error unless the
        caller says otherwise, so the peer learns what was wrong) and skipped: bad input never stops the
        caller's loop."""
        for _ in itertools.count() if limit is None else range(limit):
            try:
                routed = self.recv(timeout=0)
            except ProtocolError as exc:
                log.warning("bad message on %s: %s", self.address, exc)
                self.answer(exc.peer_id, refusal(exc))
                continue
            if routed is None:
                return
            yield routed

    def answer(self, peer_id: bytes | None, msg: Message, timeout: float = 0.1) -> None:
        """Best-effort reply: a peer that is gone, unknown (None) or not reading is logged, not raised."""
        if peer_id is None:
            return
        try:
            self.send(peer_id, msg, timeout=timeout)
        except WireError as exc:
            log.info("could not answer peer %s: %s", peer_id.hex(), exc)


class ClientSocket(_SyncSocket):
    """DEALER connected to a ServerSocket at `address`."""

    def __init__(self, address: str, *, curve: CurveClientConfig | None = None, hwm: int = DEFAULT_HWM,
                 linger: float = DEFAULT_LINGER_S, send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
                 context: zmq.Context | None = None, max_message_bytes: int = MAX_FRAME_BYTES):
        super().__init__(zmq.DEALER, address, bind=False, curve=curve, context=context, hwm=hwm, linger=linger,
                         send_timeout=send_timeout, max_message_bytes=max_message_bytes)

    def send(self, msg: Message, *buffers: Any, timeout: float | None = None) -> None:
        """Send msg (+ payload buffers, not copied) to the server."""
        self._send_parts(encode(msg, *buffers), timeout)

    def recv(self, timeout: float) -> Received | None:
        """Next message within `timeout` seconds, or None; a malformed one raises ProtocolError."""
        parts = self._recv_parts(timeout)
        if parts is None:
            return None
        return Received(*decode(parts))
