"""Registration with a router: a Heartbeat thread sends Register + the latest EngineStats every
interval on its own DEALER (a thread, so a long engine step never looks like a dead engine), and
Deregister when the engine stops. Between beats it listens on that link: what the router sends there
(KVPeers, to decode engines) goes to the `on_message` callback, on this thread. An engine given several
routers runs one Heartbeat per router. advertised_address() is the address other hosts can reach. The
engine loop hands it fresh stats as it goes round: stats older than the stall bound mean a stuck loop,
and the thread stops beating so the router takes the engine out of routing."""

from __future__ import annotations

import ipaddress
import logging
import socket as socketlib
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.control.errors import WireError
from pdserve.control.keys import CurveClientConfig
from pdserve.control.messages import Deregister, EngineStats, Register
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, ClientSocket

log = logging.getLogger("pdserve.heartbeat")

WILDCARD_HOSTS = ("0.0.0.0", "*", "::")
LISTEN_SLICE_S = 0.1  # how often the thread between beats checks whether it was stopped


def _split(address: str) -> tuple[str, str, str]:
    """tcp://host:port -> (scheme, host without brackets, port); other schemes -> (scheme, "", "")."""
    scheme, _, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    return (scheme, host.strip("[]"), port) if scheme == "tcp" and colon else (scheme, "", "")


def is_loopback_host(host: str) -> bool:
    """127.x.x.x, ::1 or localhost; a host name or a wildcard (0.0.0.0, *) is reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address_toward(address: str | None) -> str:
    """This host's IP on the route to `address` (a UDP connect sends nothing; the kernel picks the source
    address): the one a router there sees, even in a container or network namespace. Falls back to the
    host name's address when there is no route yet."""
    _, host, port = _split(address or "")
    if host:
        try:
            family, kind, _, _, target = socketlib.getaddrinfo(host, int(port), type=socketlib.SOCK_DGRAM)[0]
            with socketlib.socket(family, kind) as probe:
                probe.connect(target)
                return probe.getsockname()[0]
        except OSError:
            pass
    return socketlib.gethostbyname(socketlib.gethostname())


def advertised_address(address: str, advertise_host: str | None = None, toward: str | None = None) -> str:
    """The address a peer connects to: advertise_host (--advertise-address) when given, else a wildcard
    bind host (0.0.0.0) becomes this host's IP on the route to `toward` (the router), else the bind
    address as it is. Raises ValueError when a loopback address would be advertised to a router that is
    not on loopback: it could never connect."""
    _, host, port = _split(address)
    if not host:
        return address
    if advertise_host:
        host = advertise_host
    elif host in WILDCARD_HOSTS:
        host = local_address_toward(toward)
    _, router_host, _ = _split(toward or "")
    if is_loopback_host(host) and router_host and not is_loopback_host(router_host):
        raise ValueError(f"this engine would tell the router at {toward} to reach it at {address}, a loopback "
                         f"address that host cannot connect to: bind tcp://0.0.0.0:PORT or this host's IP, or pass "
                         f"--advertise-address HOST")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Heartbeat(threading.Thread):
    """Sends Register + the latest EngineStats to the router every interval_s seconds, from its own
    thread and DEALER socket; messages the router cannot take right now are dropped (the next beat
    repeats them), so a router that starts later or restarts learns the engine within one interval."""

    def __init__(self, router_address: str, interval_s: float, curve: CurveClientConfig | None = None,
                 stall_s: float | None = None) -> None:
        super().__init__(name="pdserve-heartbeat", daemon=True)
        self.router_address = router_address
        self.interval_s = interval_s
        self.stall_s = stall_s  # no fresh stats from the loop this long: stop beating (None: never)
        self._stalled = False
        self.register: Register | None = None  # set before start()
        self.on_message: Callable[[Any], None] | None = None  # set before start(): what the router sends
        self._stats: EngineStats | None = None
        self._stats_time = 0.0
        self._done = threading.Event()
        # used by this thread only once started; the router never answers on it
        self._client = ClientSocket(router_address, curve=curve, max_message_bytes=CONTROL_MESSAGE_BYTES)

    @property
    def socket(self):
        """The DEALER to the router (its connection events tell control/admission.py whether it took us)."""
        return self._client.socket

    def wants_stats(self) -> bool:
        return time.monotonic() - self._stats_time >= self.interval_s / 2

    def set_stats(self, stats: EngineStats) -> None:
        self._stats, self._stats_time = stats, time.monotonic()

    def run(self) -> None:
        while True:
            if not self._loop_stalled():
                self._send(self.register)
                self._send(self._stats)
            if self._listen(self.interval_s):
                break
        self._send(Deregister(engine_id=self.register.engine_id, control_address=self.register.control_address))
        self._client.close()

    def _listen(self, seconds: float) -> bool:
        """Hand what the router sends to on_message for `seconds`; True once stop() was called."""
        deadline = time.monotonic() + seconds
        while not self._done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                received = self._client.recv(timeout=min(remaining, LISTEN_SLICE_S))
            except WireError as exc:
                log.warning("the router %s sent a message that was dropped: %s", self.router_address, exc)
                continue
            if received is not None and self.on_message is not None:
                self.on_message(received.msg)
        return True

    def _loop_stalled(self) -> bool:
        """True while the engine loop has not handed over stats for stall_s seconds (logged once per stall)."""
        idle = time.monotonic() - self._stats_time
        stalled = self.stall_s is not None and idle > self.stall_s
        if stalled != self._stalled:
            if stalled:
                log.error("the engine loop made no progress for %.1fs: heartbeats stop until it does", idle)
            else:
                log.warning("the engine loop makes progress again: heartbeats resume")
            self._stalled = stalled
        return stalled

    def _send(self, msg: Any) -> None:
        try:  # bounded: a router that is down costs at most half an interval per message
            self._client.send(msg, timeout=self.interval_s / 2)
        except WireError as exc:
            log.debug("router %s did not take %s: %s", self.router_address, msg.type_name, exc)

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(timeout=2.0)
