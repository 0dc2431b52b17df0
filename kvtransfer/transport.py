"""ZeroMQ sockets of the KV link: `KVServer` (ROUTER, bound) and `KVClient` (DEALER, connected).

Why ROUTER/DEALER: the link is many-to-many, two-way and driven by the decode side. A prefill
engine binds one ROUTER at its advertised KV address; a decode engine connects one DEALER to each
prefill engine it pulls from. The DEALER may speak first (Hello, KVWant, KVAck) and the ROUTER
answers the exact peer that asked (HelloAck, KVLayer..., KVDone) by its routing id, so one socket
on P serves any number of D's. PUSH/PULL is one-way and spreads messages round-robin over peers,
so it cannot address one decode engine.

Bounded waits, chosen deliberately:
  recv(timeout)  -> None when nothing arrives in time (an idle link is normal, callers poll).
  send(...)      -> raises TransportTimeout (a TimeoutError) when no peer takes the message in time
                    (a stuck or absent peer is a failure the caller must handle).
Sockets close with a bounded linger, so closing never hangs on an unreachable peer. The ROUTER is
ROUTER_MANDATORY (a send to a gone peer raises PeerUnreachableError instead of vanishing); the
DEALER is IMMEDIATE (nothing queues until a connection, CURVE handshake included, succeeds).
ZMQ_MAXMSGSIZE drops a peer that sends a frame over protocol.MAX_FRAME_BYTES before it is buffered.

CURVE (optional, per socket): the server holds a key pair; a client holds its own key pair plus the
server's public key. With `allowed_client_keys`, the server also admits only those client public
keys (a ZAP handler on a context of its own). A socket is used by one thread only.

Payload buffers are sent without copying: keep them unchanged until the peer has them (P keeps its
blocks until KVAck anyway).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pdserve.kvtransfer.errors import (
    CurveUnavailableError,
    KVTransferError,
    PeerUnreachableError,
    ProtocolError,
    TransportError,
    TransportTimeout,
)
from pdserve.kvtransfer.protocol import MAX_FRAME_BYTES, Error, Message, decode, encode

log = logging.getLogger("pdserve.transport")

DEFAULT_HWM = 1000  # messages queued per peer before send waits
DEFAULT_LINGER_S = 1.0  # how long close() may keep flushing queued messages
DEFAULT_SEND_TIMEOUT_S = 10.0
MAX_IPC_PATH_BYTES = 107  # sun_path on Linux, minus the terminating NUL
Z85_KEY_LEN = 40


# ---- addresses ----

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


# ---- CURVE keys ----

def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveUnavailableError("CURVE was requested but this libzmq has no CURVE support: install the "
                                    "pyzmq wheel from PyPI (it bundles libsodium) or build libzmq with libsodium")


def _z85_key(key: bytes | str, name: str) -> bytes:
    key = key.encode() if isinstance(key, str) else bytes(key)
    if len(key) != Z85_KEY_LEN:
        raise TransportError(f"{name} is {len(key)} bytes: CURVE keys are {Z85_KEY_LEN}-character Z85 "
                             f"strings made by generate_curve_keypair()")
    return key


@dataclass(frozen=True)
class CurveKeyPair:
    public_key: bytes  # Z85, 40 characters
    secret_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _z85_key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", _z85_key(self.secret_key, "secret_key"))


def generate_curve_keypair() -> CurveKeyPair:
    require_curve()
    public_key, secret_key = zmq.curve_keypair()
    return CurveKeyPair(public_key, secret_key)


@dataclass(frozen=True)
class CurveServerConfig:
    keypair: CurveKeyPair
    allowed_client_keys: frozenset[bytes] | None = None  # None: any client that knows our public key

    def __post_init__(self) -> None:
        if self.allowed_client_keys is not None:
            keys = frozenset(_z85_key(k, "allowed client key") for k in self.allowed_client_keys)
            object.__setattr__(self, "allowed_client_keys", keys)


@dataclass(frozen=True)
class CurveClientConfig:
    keypair: CurveKeyPair
    server_public_key: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_public_key", _z85_key(self.server_public_key, "server_public_key"))


class _AllowList:
    """ZAP credentials provider: admits the listed client public keys (Z85)."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


# ---- sockets ----

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


class _Link:
    """Socket options, bounded send/recv and close shared by KVServer and KVClient."""

    def __init__(self, socket_type: int, *, context: zmq.Context | None, hwm: int, linger: float,
                 send_timeout: float, own_context: bool = False):
        self._context = context or zmq.Context.instance()
        self._own_context = own_context
        self._authenticator: ThreadAuthenticator | None = None
        self._send_timeout = send_timeout
        self._socket = self._context.socket(socket_type)
        self._socket.setsockopt(zmq.LINGER, _timeout_ms(linger))
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
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
            where = self._peer_name(peer_id)
            raise TransportTimeout(f"no peer took the message to {where} within {ms} ms: check that the peer "
                                   f"is up, reachable and (with CURVE) holds the right keys") from None
        except zmq.ZMQError as exc:
            where = self._peer_name(peer_id)
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachableError(f"{where} is not connected (it left or never said Hello)") from None
            raise TransportError(f"send to {where} failed: {exc}") from exc

    def _peer_name(self, peer_id: bytes | None) -> str:
        return f"peer {peer_id.hex()}" if peer_id is not None else str(getattr(self, "address", "the peer"))

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
        """The underlying socket, for a zmq.Poller that waits on several links at once."""
        return self._socket

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._socket.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> _Link:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KVServer(_Link):
    """ROUTER bound at `address` (tcp://host:port, port 0 picks a free one; or ipc://path)."""

    def __init__(self, address: str, *, curve: CurveServerConfig | None = None, hwm: int = DEFAULT_HWM,
                 linger: float = DEFAULT_LINGER_S, send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
                 context: zmq.Context | None = None):
        endpoint = validate_address(address, bind=True)
        own_context = curve is not None and curve.allowed_client_keys is not None
        if own_context:  # one ZAP handler per context: give this server's allow-list a context of its own
            require_curve()
            context = zmq.Context()
        super().__init__(zmq.ROUTER, context=context, hwm=hwm, linger=linger,
                         send_timeout=send_timeout, own_context=own_context)
        try:
            self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if curve is not None:
                self._setup_curve(curve)
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot bind {address}: {exc}: pick a free port / writable ipc path") from exc
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def _setup_curve(self, curve: CurveServerConfig) -> None:
        require_curve()
        if curve.allowed_client_keys is not None:
            self._authenticator = ThreadAuthenticator(self._context)
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", _AllowList(curve.allowed_client_keys))
        self._socket.curve_secretkey = curve.keypair.secret_key
        self._socket.curve_publickey = curve.keypair.public_key
        self._socket.curve_server = True

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


    def drain(self) -> Iterator[Routed]:
        """Every message waiting now. A malformed one is logged, answered with Error (so the peer
        learns what was wrong) and skipped: bad input never stops the caller's loop."""
        while True:
            try:
                routed = self.recv(timeout=0)
            except ProtocolError as exc:
                log.warning("bad message on %s: %s", self.address, exc)
                self.answer(exc.peer_id, Error.from_exception(exc))
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
        except KVTransferError as exc:
            log.info("could not answer peer %s: %s", peer_id.hex(), exc)


class KVClient(_Link):
    """DEALER connected to a KVServer at `address`."""

    def __init__(self, address: str, *, curve: CurveClientConfig | None = None, hwm: int = DEFAULT_HWM,
                 linger: float = DEFAULT_LINGER_S, send_timeout: float = DEFAULT_SEND_TIMEOUT_S,
                 context: zmq.Context | None = None):
        endpoint = validate_address(address, bind=False)
        super().__init__(zmq.DEALER, context=context, hwm=hwm, linger=linger, send_timeout=send_timeout)
        try:
            self._socket.setsockopt(zmq.IMMEDIATE, 1)
            if curve is not None:
                require_curve()
                self._socket.curve_secretkey = curve.keypair.secret_key
                self._socket.curve_publickey = curve.keypair.public_key
                self._socket.curve_serverkey = curve.server_public_key
            self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        self.address = address

    def send(self, msg: Message, *buffers: Any, timeout: float | None = None) -> None:
        """Send msg (+ payload buffers, not copied) to the server."""
        self._send_parts(encode(msg, *buffers), timeout)

    def recv(self, timeout: float) -> Received | None:
        """Next message within `timeout` seconds, or None; a malformed one raises ProtocolError."""
        parts = self._recv_parts(timeout)
        if parts is None:
            return None
        return Received(*decode(parts))
