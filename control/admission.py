"""Whether a router admitted this engine. An engine registers by sending on its heartbeat DEALER; a
router that refuses its keys never hears it, and the engine would serve nothing for ever. The engine
is admitted once a router reaches it (any message on its control socket, or on the registration link).
Until then the watch reads the DEALER's connection events: handshakes that fail (three, or one that
fails on the security mechanism, which ZeroMQ never retries) mean the router refused this engine's keys; a handshake that succeeds but no router reaching the engine within `timeout_s`
means the router took the registration and did not admit it. A router that does not listen yet is
neither: the engine waits for it. A refusal is the engine's exit (EXIT_NOT_ADMITTED), said in one
sentence with the fix.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

EXIT_NOT_ADMITTED = 3
FAILED_HANDSHAKES_TO_REFUSE = 3  # ZeroMQ retries every 0.1 s: a refusal is told within a second or two
CHECK_INTERVAL_S = 0.5
_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH}


class NotAdmitted(Exception):
    """A router refused this engine: the message says why and what to do."""


class AdmissionWatch:
    def __init__(self, router_address: str, socket: zmq.Socket, control_address: str, timeout_s: float = 30.0,
                 secured: bool = True) -> None:
        self.router_address, self.control_address = router_address, control_address
        self.timeout_s, self.secured = timeout_s, secured
        # made from the thread that made `socket`, before the heartbeat thread uses it; read on the engine loop
        self.monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(_FAILED))
        # The DEALER connected before the monitor existed, and its first handshake may be over already: one that
        # failed on the mechanism is never retried. Connect again, so that the monitor sees a handshake.
        endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint:
            socket.disconnect(endpoint)
            socket.connect(endpoint)
        self.admitted = False
        self.num_failed = 0
        self.mechanism_mismatch = False  # one side uses CURVE and the other not: ZeroMQ does not retry it
        self.handshake_at: float | None = None
        self._checked = 0.0

    def check(self) -> None:
        """Raises NotAdmitted once the router's refusal is certain (called from the engine loop; cheap)."""
        now = time.monotonic()
        if now - self._checked < CHECK_INTERVAL_S:
            return
        self._checked = now
        self._read_events(now)
        if self.admitted:
            return
        refused = self.mechanism_mismatch or self.num_failed >= FAILED_HANDSHAKES_TO_REFUSE
        if refused and self.handshake_at is None:
            keys = "the cluster's CURVE keys" if self.secured else "no CURVE keys (--insecure)"
            raise NotAdmitted(
                f"the router at {self.router_address} refused this engine: {self.num_failed} connection "
                f"handshake{'s' if self.num_failed != 1 else ''} failed, as they do when the engine runs with {keys} and the router with other keys; start the "
                "engine with the router's key directory (--curve-dir DIR, the one `pdserve up` or `pdserve keygen` "
                "made)")
        if self.handshake_at is not None and now - self.handshake_at > self.timeout_s:
            raise NotAdmitted(
                f"the router at {self.router_address} took this engine's registration but did not reach it at "
                f"{self.control_address} within {self.timeout_s:g}s, so it was not admitted: make that address "
                "reachable from the router (--control-address, --advertise-address HOST) and see the router's log")

    def _read_events(self, now: float) -> None:
        while self.monitor.poll(0):
            message = recv_monitor_message(self.monitor)
            event = message["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_at = self.handshake_at or now
            elif event in _FAILED:
                self.num_failed += 1
                self.mechanism_mismatch |= message["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH

    def close(self) -> None:
        self.monitor.close(linger=0)
