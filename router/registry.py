"""EngineRegistry: which engines exist, which are routable, and their latest load figures.

Engines come from two places:
  * registration: an engine started with `--router-address` connects a DEALER to the router's
    registration ROUTER and sends Register + EngineStats every heartbeat, Deregister when it stops;
  * static addresses (`--prefill` / `--decode` control addresses): the router asks them to describe
    themselves (DescribeRequest -> Register: role, KV address, limits) and polls their stats.

Either way the router talks to an engine over its own EngineLink to the engine's control socket. An
engine becomes routable once that link has answered, and leaves routing at once when the link's
connection drops (the process died), or when nothing was heard from it for heartbeat_timeout_s (a
stuck or unreachable engine): its open requests get EngineGone (the generation code retries
them elsewhere when no token was streamed yet). A registered engine that leaves is forgotten (it
registers again if it comes back); a static one is kept and polled until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pdserve.control.errors import ProtocolError, TransportError
from pdserve.control.keys import load_cluster_keys
from pdserve.control.messages import Deregister, DescribeRequest, EngineStats, Register
from pdserve.control.protocol import decode
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, OpenSocket, open_socket, validate_address
from pdserve.router.config import RouterConfig
from pdserve.router.link import EngineLink

log = logging.getLogger("pdserve.router.registry")

ROLES = ("prefill", "decode")


class EngineRegistry:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.context = zmq.asyncio.Context()
        self.curve = load_cluster_keys(config.curve_dir) if config.curve_dir else None
        self.links: dict[str, EngineLink] = {}  # control address -> link
        self.expected_roles: dict[str, str] = {}  # static control address -> the role it was given as
        self.registration_address: str | None = None
        self.on_change: list = []  # callbacks(link) when an engine joins or leaves routing
        self._peers: dict[bytes, str] = {}  # registration peer id -> control address
        self._tasks: list[asyncio.Task] = []
        self._registration: OpenSocket | None = None

    async def start(self) -> None:
        if self.config.registration_address:
            self._bind_registration(self.config.registration_address)
            self._tasks.append(asyncio.create_task(self._registration_loop(), name="registration"))
        for role, addresses in (("prefill", self.config.prefill_addresses), ("decode", self.config.decode_addresses)):
            for address in addresses:
                validate_address(address, bind=False)
                self.expected_roles[address] = role
                self.links[address] = EngineLink(address, self.context, static=True, curve=self._client_keys())
        self._tasks.append(asyncio.create_task(self._liveness_loop(), name="liveness"))

    def _bind_registration(self, address: str) -> None:
        # engines must hold the cluster's keys to register: the server config admits only its client key
        try:
            self._registration = open_socket(zmq.ROUTER, address, bind=True, context=self.context,
                                             curve=self.curve.server if self.curve else None, linger_s=0,
                                             max_message_bytes=CONTROL_MESSAGE_BYTES)
        except TransportError as exc:
            raise ValueError(f"cannot bind the registration address {address}: {exc}") from exc
        self.registration_address = self._registration.address

    def _client_keys(self):
        return self.curve.client if self.curve is not None else None

    # ---- queries ----

    def engines(self, role: str) -> list[EngineLink]:
        """Routable engines of one role."""
        return [link for link in self.links.values() if link.up and link.role == role]

    def max_model_len(self) -> int | None:
        """The context length every routable decode engine accepts (None when there is none)."""
        lengths = [link.info.max_model_len for link in self.engines("decode")]
        return min(lengths) if lengths else None

    def vocab_size(self) -> int | None:
        sizes = [link.info.vocab_size for link in self.engines("decode")]
        return min(sizes) if sizes else None

    async def refresh_stats(self, timeout: float = 0.5) -> None:
        """Ask every routable engine for its stats now (for /metrics), waiting at most `timeout`."""
        links = [link for link in self.links.values() if link.up]
        await asyncio.gather(*(link.fresh_stats(timeout) for link in links))

    # ---- registration ----

    async def _registration_loop(self) -> None:
        while True:
            parts = await self._registration.socket.recv_multipart(copy=False)
            peer_id = parts[0].bytes
            try:
                msg, _ = decode(parts[1:])
            except ProtocolError as exc:
                log.warning("bad message on the registration socket: %s", exc)
                continue
            if isinstance(msg, Register):
                self._on_register(peer_id, msg)
            elif isinstance(msg, EngineStats):
                link = self.links.get(self._peers.get(peer_id, ""))
                if link is not None:
                    link.set_stats(msg)
            elif isinstance(msg, Deregister):
                link = self.links.get(msg.control_address)
                if link is not None:
                    await self._leave(link, f"engine {link.engine_id} stopped")

    def _on_register(self, peer_id: bytes, msg: Register) -> None:
        self._peers[peer_id] = msg.control_address
        link = self.links.get(msg.control_address)
        if link is None:
            log.info("engine %s (%s) registered from %s", msg.engine_id, msg.role, msg.control_address)
            link = self.links[msg.control_address] = EngineLink(msg.control_address, self.context,
                                                                curve=self._client_keys())
            link.try_send_stats_request()  # the first answer proves the link works
        link.info = msg
        link.last_seen = time.monotonic()
        self._assign_label(link)

    def _assign_label(self, link: EngineLink) -> None:
        """Engine ids name engines in metrics; scaled replicas may share one, so add the address then."""
        same_id = [other for other in self.links.values() if other is not link and other.engine_id == link.engine_id]
        link.label = f"{link.engine_id}@{link.control_address}" if same_id else link.engine_id

    # ---- liveness ----

    async def _liveness_loop(self) -> None:
        period = min(0.25, self.config.heartbeat_timeout_s / 4)
        last_poll = 0.0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            poll = now - last_poll >= self.config.stats_interval_s
            if poll:
                last_poll = now
            for link in list(self.links.values()):
                await self._check(link, now, poll)

    def _timeout(self, link: EngineLink) -> float:
        """The router's heartbeat timeout, stretched for an engine that beats slowly (3 beats)."""
        interval = link.info.heartbeat_interval_s if link.info else 0.0
        return max(self.config.heartbeat_timeout_s, 3 * interval)

    async def _check(self, link: EngineLink, now: float, poll: bool) -> None:
        if link.broken is not None:
            reason, link.broken = link.broken, None
            if link.up:
                await self._leave(link, reason)
                return
        fresh = now - link.last_seen <= self._timeout(link)
        if not fresh and (link.up or not link.static):
            await self._leave(link, f"engine {link.engine_id} missed heartbeats for {now - link.last_seen:.1f}s")
            return
        if link.up:
            if link.static and poll:
                link.try_send_stats_request()
            return
        self._probe(link)
        if fresh and link.num_received > 0 and self._usable(link):
            link.up = True
            self._notify(link)
            log.info("engine %s (%s) joined routing at %s", link.engine_id, link.role, link.control_address)

    def _probe(self, link: EngineLink) -> None:
        """A link not yet (or no longer) routable: ask the engine to show itself."""
        if link.static:
            link.try_send(DescribeRequest())
        else:
            link.try_send_stats_request()

    def _usable(self, link: EngineLink) -> bool:
        if link.info is None:
            return False
        expected = self.expected_roles.get(link.control_address)
        if expected is not None and link.info.role != expected:
            log.error("engine at %s is a %s engine but was given as --%s: fix the router's arguments",
                      link.control_address, link.info.role, expected)
            return False
        if link.info.role == "prefill" and not link.info.kv_address:
            log.error("prefill engine %s has no KV address", link.engine_id)
            return False
        self._assign_label(link)
        return True

    async def _leave(self, link: EngineLink, reason: str) -> None:
        was_up = link.up
        link.up = False
        link.fail_streams(reason)
        self._notify(link)
        if was_up:
            log.warning("%s: it leaves routing", reason)
        if link.static:
            link.last_seen = 0.0  # stays out until it answers again
            link.num_received = 0
            return
        self.links.pop(link.control_address, None)
        self._peers = {peer: address for peer, address in self._peers.items() if address != link.control_address}
        await link.close()

    def _notify(self, link: EngineLink) -> None:
        for callback in self.on_change:
            callback(link)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
        if self._registration is not None:
            self._registration.close(linger_s=0)
        self.context.term()
