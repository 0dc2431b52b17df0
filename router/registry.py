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

Each registered entry belongs to the registration connection that registered it: Register, stats and
Deregister for that engine are taken from that connection only (a spoofed Deregister from another
peer is refused). The entry passes to a new connection only once its owner has been silent for the
heartbeat timeout or the engine left routing (a restarted engine registers again from a new socket).
A Register with a new incarnation (a random id each engine process makes at start) is a restarted engine
at the same address: the old entry leaves routing at once (its open requests get EngineGone) and the new
one takes its place, from whichever connection sent it.
Every decode (or dual-role) engine that registers gets KVPeers back on its registration link: the KV addresses
of the prefill-capable engines (prefill and dual roles) the router knows, the only ones it will pull KV from (docs/serving/security.md), with
the incarnation registered at each (a decode engine renews its KV link to one that restarted).

The registration socket takes any number of peers: it tracks at most MAX_REGISTRATION_PEERS of them
(the least recently heard are forgotten) and holds at most MAX_PENDING_ENGINES links to engines that
registered but have not answered yet (more are refused until some answer or time out). A message
that cannot be handled is logged and skipped; if the loop itself fails, it is logged and restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import zmq
import zmq.asyncio

from pdserve.control.errors import ProtocolError, TransportError
from pdserve.control.keys import load_cluster_keys
from pdserve.control.messages import MAX_KV_PEERS, Deregister, DescribeRequest, EngineStats, KVPeers, Register
from pdserve.control.protocol import decode, encode
from pdserve.control.schema import Message
from pdserve.control.sockets import CONTROL_MESSAGE_BYTES, OpenSocket, open_socket, validate_address
from pdserve.router.config import RouterConfig
from pdserve.router.link import EngineLink

log = logging.getLogger("pdserve.router.registry")

DUAL = "dual"  # a dual-role engine (`pdserve engine`): a member of both pools
KV_SERVING_ROLES = ("prefill", DUAL)  # engines that serve KV to others: their KV addresses are every puller's peers
KV_PULLING_ROLES = ("decode", DUAL)  # engines told those peers (KVPeers)
MAX_REGISTRATION_PEERS = 4096
MAX_PENDING_ENGINES = 64
RESTART_DELAY_S = 1.0
REFUSAL_LOG_INTERVAL_S = 1.0  # refused registration messages are logged at most this often


class EngineRegistry:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.context = zmq.asyncio.Context()
        self.curve = load_cluster_keys(config.curve_dir) if config.curve_dir else None
        self.links: dict[str, EngineLink] = {}  # control address -> link
        self.expected_roles: dict[str, str] = {}  # static control address -> the role it was given as
        self.registration_address: str | None = None
        self.on_change: list = []  # callbacks(link) when an engine joins or leaves routing
        self._peers: OrderedDict[bytes, str] = OrderedDict()  # registration peer id -> control address, LRU
        self._tasks: list[asyncio.Task] = []
        self._registration: OpenSocket | None = None
        self._last_refusal_log = 0.0
        self._stats_refresh: asyncio.Future | None = None  # the /metrics refresh in flight
        self._kv_peers: dict[str, str] = {}  # what the decode engines were last told: KV address -> incarnation

    def bind(self) -> None:
        """Bind the registration socket now, before the event loop runs (ZeroMQ queues what engines send until
        the loop reads it): engines can register while the router still loads its tokenizer. start() binds it
        otherwise."""
        if self.config.registration_address and self._registration is None:
            self._bind_registration(self.config.registration_address)

    def unbind(self) -> None:
        """Close what bind() opened when the router fails before it starts (a ZAP thread left running would keep
        the process from exiting)."""
        if self._registration is not None:
            self._registration.close(linger_s=0)
            self._registration = None
        self.context.term()

    async def start(self) -> None:
        if self.config.registration_address:
            self.bind()
            self._tasks.append(asyncio.create_task(self._serve_registration(), name="registration"))
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
        """Routable engines that can take one role: its fixed-role engines and every dual-role one."""
        return [link for link in self.links.values() if link.up and link.role in (role, DUAL)]

    def max_model_len(self) -> int | None:
        """The context length every routable decode engine accepts (None when there is none)."""
        limits = self.decode_limits()
        return None if limits is None else limits[0]

    def decode_limits(self) -> tuple[int, int] | None:
        """(context length, vocabulary size) every routable decode engine accepts, from one pass over the
        engines (None when there is none)."""
        infos = [link.info for link in self.engines("decode")]
        if not infos:
            return None
        return min([info.max_model_len for info in infos]), min([info.vocab_size for info in infos])

    async def refresh_stats(self, timeout: float = 0.5) -> None:
        """Ask every routable engine for its stats now (for /metrics), waiting at most `timeout`. Scrapes that
        arrive while a refresh is in flight share it: a flood of scrapes asks each engine one at a time."""
        if self._stats_refresh is None or self._stats_refresh.done():
            links = [link for link in self.links.values() if link.up]
            self._stats_refresh = asyncio.gather(*(link.fresh_stats(timeout) for link in links))
        await asyncio.shield(self._stats_refresh)  # a scraper that leaves does not cancel the others' refresh

    # ---- registration ----

    async def _serve_registration(self) -> None:
        while True:
            try:
                await self._registration_loop()
            except Exception:  # noqa: BLE001 - the socket failed: engines must still be able to register
                log.exception("the registration loop failed: restarting it in %.0fs", RESTART_DELAY_S)
                await asyncio.sleep(RESTART_DELAY_S)

    async def _registration_loop(self) -> None:
        while True:
            parts = await self._registration.socket.recv_multipart(copy=False)
            try:
                await self._on_registration_message(parts[0].bytes, parts[1:])
            except Exception:  # noqa: BLE001 - one peer's message must not stop registration for all
                log.exception("a message on the registration socket could not be handled: skipped")

    async def _on_registration_message(self, peer_id: bytes, frames: list) -> None:
        try:
            msg, _ = decode(frames)
        except ProtocolError as exc:
            log.warning("bad message on the registration socket: %s", exc)
            return
        if isinstance(msg, Register):
            await self._on_register(peer_id, msg)
        elif isinstance(msg, EngineStats):
            link = self._owned_link(peer_id, self._peer_address(peer_id))
            if link is not None:
                link.set_stats(msg)
        elif isinstance(msg, Deregister):
            link = self._owned_link(peer_id, msg.control_address)
            if link is not None:
                await self._leave(link, f"engine {link.engine_id} stopped")
            elif msg.control_address in self.links:
                self._refused(f"Deregister for {msg.control_address} from a connection that did not register it")

    def _owned_link(self, peer_id: bytes, address: str | None) -> EngineLink | None:
        """The link at address if peer_id is the connection that registered it (else None)."""
        link = self.links.get(address or "")
        if link is None or link.owner != peer_id:
            return None
        link.owner_heard = time.monotonic()
        return link

    def _may_take(self, link: EngineLink, peer_id: bytes) -> bool:
        """May peer_id register (or re-register) the engine at this link? Its owner may; another
        connection only once the owner has been silent for the heartbeat timeout."""
        if link.owner is None or link.owner == peer_id:
            return True
        return time.monotonic() - link.owner_heard > self._timeout(link)

    def _refused(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_refusal_log >= REFUSAL_LOG_INTERVAL_S:
            self._last_refusal_log = now
            log.warning("%s: refused (an engine may change only its own entry)", what)

    def _peer_address(self, peer_id: bytes) -> str | None:
        address = self._peers.get(peer_id)
        if address is not None:
            self._peers.move_to_end(peer_id)
        return address

    def _remember_peer(self, peer_id: bytes, address: str) -> None:
        self._peers[peer_id] = address
        self._peers.move_to_end(peer_id)
        while len(self._peers) > MAX_REGISTRATION_PEERS:
            self._peers.popitem(last=False)

    def _can_add_engine(self) -> bool:
        pending = sum(1 for link in self.links.values() if not link.up and not link.static)
        return pending < MAX_PENDING_ENGINES

    async def _on_register(self, peer_id: bytes, msg: Register) -> None:
        link = self.links.get(msg.control_address)
        if link is not None and _restarted(link, msg):
            await self._leave(link, f"engine {msg.engine_id} at {msg.control_address} restarted (incarnation "
                                    f"{link.info.incarnation}, now {msg.incarnation})")
            link = self.links.get(msg.control_address)  # a registered entry is gone; a static one stays, unowned
        if link is None:
            if not self._can_add_engine():
                log.warning("engine %s at %s not admitted: %d registered engines have not answered yet",
                            msg.engine_id, msg.control_address, MAX_PENDING_ENGINES)
                return
            link = EngineLink(msg.control_address, self.context, curve=self._client_keys())
            self.links[msg.control_address] = link
            log.info("engine %s (%s) registered from %s", msg.engine_id, msg.role, msg.control_address)
            link.try_send_stats_request()  # the first answer proves the link works
        elif not self._may_take(link, peer_id):
            self._refused(f"Register for {msg.control_address} from a connection other than its owner's")
            return
        self._remember_peer(peer_id, msg.control_address)
        link.owner, link.owner_heard = peer_id, time.monotonic()
        link.info = msg
        link.last_seen = time.monotonic()
        self._assign_label(link)
        self._announce_kv_peers()
        if msg.role in KV_PULLING_ROLES:
            self._answer(peer_id, self._kv_peers_message())

    # ---- the KV peers decode engines may pull from ----

    def _current_kv_peers(self) -> dict[str, str]:
        """KV address -> the incarnation registered there, for every prefill-capable engine known (prefill and dual
        roles; at most MAX_KV_PEERS)."""
        peers = {link.info.kv_address: link.info.incarnation for link in self.links.values()
                 if link.info is not None and link.info.role in KV_SERVING_ROLES and link.info.kv_address}
        return dict(sorted(peers.items())[:MAX_KV_PEERS])

    def _kv_peers_message(self) -> KVPeers:
        return KVPeers(kv_addresses=tuple(self._kv_peers),
                       incarnations={address: known for address, known in self._kv_peers.items() if known})

    def _announce_kv_peers(self) -> None:
        """Tell every registered decode and dual engine when the set of prefill KV addresses changed."""
        peers = self._current_kv_peers()
        if peers == self._kv_peers:
            return
        self._kv_peers = peers
        message = self._kv_peers_message()
        for link in self.links.values():
            if link.owner is not None and link.info is not None and link.info.role in KV_PULLING_ROLES:
                self._answer(link.owner, message)

    def _answer(self, peer_id: bytes, msg: Message) -> None:
        """Send on the registration socket without waiting; a peer that cannot take it now gets the
        next one (decode engines hear KVPeers again with every heartbeat)."""
        if self._registration is None:
            return
        try:
            self._registration.socket.send_multipart([peer_id, *encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("registration peer did not take %s: %s", msg.type_name, exc)

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
            self._announce_kv_peers()
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
        if expected is not None and link.info.role not in (expected, DUAL):  # a dual engine serves either
            log.error("engine at %s is a %s engine but was given as --%s: fix the router's arguments",
                      link.control_address, link.info.role, expected)
            return False
        if link.info.role in KV_SERVING_ROLES and not link.info.kv_address:
            log.error("%s engine %s has no KV address", link.info.role, link.engine_id)
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
        link.owner = None  # a restarted engine registers again from a new connection
        if link.static:
            link.last_seen = 0.0  # stays out until it answers again
            link.num_received = 0
        else:
            self.links.pop(link.control_address, None)
            self._peers = OrderedDict((peer, address) for peer, address in self._peers.items()
                                      if address != link.control_address)
            await link.close()
        self._announce_kv_peers()

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


def _restarted(link: EngineLink, msg: Register) -> bool:
    """Whether msg registers a new process at the link's address (both incarnations known and different)."""
    known = link.info.incarnation if link.info is not None else ""
    return bool(known and msg.incarnation and known != msg.incarnation)
