"""Decode role, transfer side: the links to prefill engines. Asks for a prompt's KV, writes the frames
straight into the blocks the scheduler allocated, verifies them and acks.

One DEALER link per prefill engine (opened on first use, Hello + fingerprint first). Everything runs on
the engine loop's thread and nothing on it waits for a peer: what a link cannot take yet (it is still
connecting) waits in the link's outbox, `receive()` retries it between steps, and a link that takes
nothing for CONNECT_TIMEOUT_S fails the transfers waiting on it (they are recomputed or fail) and is
dropped. `receive()` also drains the links and ends transfers that timed out.

A prefill engine that restarts on the same address is a new peer: its HelloAck and errors carry a new
incarnation, it answers a link it never saw Hello on with `no_hello`, and the router lists the new incarnation
in KVPeers; before that, the link's connection to the old process drops. Any of these makes the link stale: a new link (new socket, new Hello) replaces it, what the new
engine refused for want of a Hello goes again on it, and every other transfer asked on an older link fails at
once (recomputed here) instead of waiting out its timeout.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.decode.incoming import IncomingState, IncomingTransfer
from pdserve.decode.kv_peers import KVPeerTrust
from pdserve.decode.kv_writer import KVWriter
from pdserve.engine.kv_cache_groups import BlockIds, CacheLayers
from pdserve.engine.kv_connector import KVTransferSide
from pdserve.control.errors import ProtocolError, WireError
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.fingerprint import LayoutFingerprint, for_cache
from pdserve.kvtransfer.layout import LinkLayout
from pdserve.control.messages import Abort, Error
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVDone, KVHold, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums
from pdserve.control.keys import CurveClientConfig
from pdserve.control.sockets import ClientSocket

log = logging.getLogger("pdserve.decode.transfer_side")

CONNECT_TIMEOUT_S = 2.0  # a message a link has not taken by then fails its transfer
MAX_HELD = 4096  # requests whose KVHold went out and whose KVWant has not yet, remembered (newest kept)


@dataclass
class _Outgoing:
    msg: Hello | KVHold | KVWant | Abort
    incoming: IncomingTransfer | None  # the transfer a KVWant asks for
    queued: float  # time.monotonic()


@dataclass
class _PrefillLink:
    address: str
    client: ClientSocket
    serial: int  # links are numbered as they open: a later link to an address has a larger serial
    refused: str | None = None  # why the prefill engine refused the link (layout mismatch ...)
    outbox: deque[_Outgoing] = field(default_factory=deque)  # not taken yet, in order
    peer_incarnation: str = ""  # from its HelloAck
    stale: str | None = None  # why the link no longer reaches the engine it said Hello to (renewed after the drain)
    refused_for_hello: set[str] = field(default_factory=set)  # requests the engine answered `no_hello`
    monitor: zmq.Socket | None = None  # the DEALER's disconnect events
    drop_seen: bool = False  # a disconnect not yet reported (it may come before the HelloAck it concerns is read)

    def close(self) -> None:
        if self.monitor is not None:
            self.client.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.client.close()

    def connection_dropped(self) -> bool:
        """Whether the connection to the engine that accepted our Hello dropped (that process died, or the
        network between us failed) since the last call. Before a HelloAck nothing counts: a peer that is not
        up yet, or refuses our keys, is the connect timeout's business. A drop seen before the HelloAck is read
        is kept: that HelloAck came over the connection that dropped."""
        while self.monitor is not None and self.monitor.poll(0):
            self.drop_seen |= recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        if not (self.drop_seen and self.peer_incarnation):
            return False
        self.drop_seen = False
        return True


class DecodeTransferSide(KVTransferSide):
    def __init__(self, fingerprint: LayoutFingerprint, engine_id: str, timeout_s: float = 30.0,
                 curve: CurveClientConfig | None = None, queue_timeout_s: float = 600.0,
                 incarnation: str = "", kv_peers: KVPeerTrust | None = None) -> None:
        super().__init__()
        self.fingerprint = fingerprint
        self.layout: LinkLayout = fingerprint.link_layout()  # which tokens of which layers travel
        self.engine_id = engine_id
        self.incarnation = incarnation  # this process's, in every Hello
        self.kv_peers = kv_peers  # what the routers say is registered at each address
        # A prompt's KV may take queue_timeout_s from the KVWant while the prefill engine has not computed
        # it (its queue and its compute), then timeout_s from when it has (prompt_computed).
        for flag, seconds in (("--kv-timeout", timeout_s), ("--kv-queue-timeout", queue_timeout_s)):
            if not seconds > 0:
                raise ValueError(f"{flag} {seconds:g} must be > 0 seconds")
        self.timeout_s = timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.curve = curve
        self.writer: KVWriter | None = None  # set when the cache is bound
        self.transfers: dict[str, IncomingTransfer] = {}  # shared with the scheduler side
        self._links: dict[str, _PrefillLink] = {}
        self._num_links = 0
        # per address: the serial of the first link to the incarnation there now (older links reached a
        # predecessor), the incarnation last seen, and the one the routers last announced
        self._restarted_at: dict[str, int] = {}
        self._incarnations: dict[str, str] = {}
        self._announced: dict[str, str] = {}
        self._greeted: set[str] = set()  # trusted addresses a link was opened to before any request named them
        self._held: OrderedDict[str, tuple[str, int]] = OrderedDict()  # KVHold sent: request id -> (address, serial)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """The cache [num_layers, planes, num_blocks, block_size, *per_token] the KV goes into, or with layer
        groups (bind_kv_groups) [layers_per_group, ...] written through each group's blocks; the
        fingerprint takes its planes and per-token shape from it."""
        layers = CacheLayers.of_cache(kv_cache.shape[0], self.kv_groups)
        self.fingerprint = for_cache(self.fingerprint, (layers.num_layers, *kv_cache.shape[1:]))
        self.layout = self.fingerprint.link_layout()
        self.writer = KVWriter(kv_cache, layers)

    def tables(self, block_ids: BlockIds) -> tuple[list[int], ...]:
        """A request's block ids (get_block_ids) as one table per block table of the bound cache."""
        return self.writer.layers.tables(block_ids)

    def sockets(self) -> list:
        return [link.client.socket for link in self._links.values()]

    def close(self) -> None:
        for link in self._links.values():
            link.close()

    # ---- asked by the scheduler side ----

    def hold(self, request_id: str, address: str) -> None:
        """Tell the prefill engine at `address` that the request is queued here (KVHold): it keeps the
        computed prompt's KV until this engine has blocks for it and asks, rather than --kv-want-timeout."""
        try:
            link = self._link(address)
        except WireError:
            return  # the KVWant will fail the same way, and say why
        self._held[request_id] = (address, link.serial)
        self._held.move_to_end(request_id)
        while len(self._held) > MAX_HELD:
            self._held.popitem(last=False)
        self._queue(link, KVHold(request_id=request_id))

    def ask(self, incoming: IncomingTransfer) -> None:
        """Send the KVWant (opening the link first if this is its first request), without waiting."""
        incoming.first_positions = self.layout.first_positions(incoming.skip_tokens + incoming.num_tokens,
                                                               incoming.skip_tokens)
        incoming.layer_tokens_received = [0] * self.layout.num_layers
        try:
            link = self._link(incoming.address)
        except KVTransferError as exc:  # refused already: the same reason as the transfers it failed then
            self._fail(incoming, str(exc))
            return
        except WireError as exc:
            self._fail(incoming, f"cannot reach prefill engine {incoming.address}: {exc}")
            return
        held = self._held.pop(incoming.request_id, None)
        if held is not None and held[1] < self._restarted_at.get(incoming.address, 0):
            self._fail(incoming, f"the prefill engine at {incoming.address} restarted after this request reached it: "
                                 "its KV is gone")
            self._queue(link, Abort(request_id=incoming.request_id, reason="sent to the previous incarnation"))
            return
        self._want(link, incoming)

    def _want(self, link: _PrefillLink, incoming: IncomingTransfer) -> None:
        incoming.link_serial = link.serial
        want = KVWant(request_id=incoming.request_id, skip_tokens=incoming.skip_tokens, num_tokens=incoming.num_tokens)
        link.outbox.append(_Outgoing(want, incoming, time.monotonic()))
        self._flush(link)

    def _queue(self, link: _PrefillLink, msg: KVHold | Abort) -> None:
        """Send after what the link has queued (its Hello first), without waiting."""
        link.outbox.append(_Outgoing(msg, None, time.monotonic()))
        self._flush(link)

    def abort(self, incoming: IncomingTransfer, reason: str) -> None:
        """Tell the prefill engine to stop and free its side (a KVWant it never took is withdrawn)."""
        self._held.pop(incoming.request_id, None)
        link = self._links.get(incoming.address)
        if link is not None:
            link.outbox = deque(item for item in link.outbox if item.incoming is not incoming)
            self._send_quietly(link, Abort(request_id=incoming.request_id, reason=reason))

    def _link(self, address: str) -> _PrefillLink:
        link = self._links.get(address)
        if link is None:
            # no KVLayer frame can be larger than our whole cache: a bigger one drops the link
            client = ClientSocket(address, curve=self.curve, max_message_bytes=self.writer.kv_cache.nbytes)
            self._num_links += 1
            link = _PrefillLink(address, client, self._num_links,
                                monitor=client.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            self._links[address] = link
            hello = Hello(fingerprint=self.fingerprint.to_dict(), role="decode", engine_id=self.engine_id,
                          incarnation=self.incarnation)
            link.outbox.append(_Outgoing(hello, None, time.monotonic()))
        if link.refused:
            raise KVTransferError(f"prefill engine refused the KV link: {link.refused}")
        return link

    def _flush(self, link: _PrefillLink) -> None:
        """Hand the link's outbox to its socket in order, as far as it takes it now; a message it has not
        taken for CONNECT_TIMEOUT_S drops the link and fails every transfer waiting on it."""
        while link.outbox:
            head = link.outbox[0]
            try:
                link.client.send(head.msg, timeout=0)
            except WireError as exc:
                if time.monotonic() - head.queued > CONNECT_TIMEOUT_S:
                    self._drop_link(link, f"cannot reach prefill engine {link.address} within "
                                          f"{CONNECT_TIMEOUT_S:g}s: {exc}")
                return
            link.outbox.popleft()

    def _drop_link(self, link: _PrefillLink, reason: str) -> None:
        # every transfer asked on this link (its KVWant sent or still in the outbox) ends: no KV will come
        for incoming in list(self.transfers.values()):
            if incoming.address == link.address and incoming.state is IncomingState.RECEIVING:
                self._fail(incoming, reason)
        link.close()
        del self._links[link.address]

    # ---- incoming ----

    def receive(self) -> None:
        """Send what links can take now, handle every message waiting on any link, then end the transfers
        that timed out."""
        for link in list(self._links.values()):
            self._flush(link)
            if link.address not in self._links:
                continue
            if link.connection_dropped():
                link.stale = f"its connection to incarnation {link.peer_incarnation} dropped"
            while True:
                try:
                    received = link.client.recv(timeout=0)
                except ProtocolError as exc:
                    log.warning("bad message from %s: %s", link.address, exc)
                    if exc.request_id:
                        self._fail_id(exc.request_id, f"bad KV message: {exc}", link, ack=True)
                    continue
                if received is None:
                    break
                self._dispatch(link, received.msg, received.frames)
            if link.stale:
                self._renew(link)
        self._follow_routers()
        self._expire()

    def _dispatch(self, link: _PrefillLink, msg, frames) -> None:
        if isinstance(msg, HelloAck):
            self._on_hello_ack(link, msg)
        elif isinstance(msg, KVLayer):
            self._on_layer(link, msg, frames[0])
        elif isinstance(msg, KVDone):
            self._on_done(link, msg)
        elif isinstance(msg, Error):
            self._on_error(link, msg)
        elif isinstance(msg, Abort):
            self._fail_id(msg.request_id, f"prefill engine aborted: {msg.reason}", link)
        else:
            log.warning("unexpected %s from %s ignored", msg.type_name, link.address)

    def _on_error(self, link: _PrefillLink, msg: Error) -> None:
        """A request's error fails that transfer. `no_hello`, an error from an incarnation other than the one
        that accepted our Hello, or one that names no request, means the link is stale: it is renewed once the
        drain is done, and what `no_hello` named goes again on the new link."""
        if link.refused:  # what was sent before the refusal came back is answered no_hello: nothing new
            return
        if msg.code == "no_hello":
            link.stale = f"it reached an engine (incarnation {msg.incarnation or 'unknown'}) that never had our Hello"
            if msg.request_id:
                link.refused_for_hello.add(msg.request_id)
            return
        if msg.incarnation and link.peer_incarnation and msg.incarnation != link.peer_incarnation:
            link.stale = f"an error came from incarnation {msg.incarnation}, not {link.peer_incarnation}"
        if msg.request_id:
            self._fail_id(msg.request_id, f"prefill engine error: {msg.message}", link)
        else:
            log.warning("prefill engine %s answered an error that names no request (%s: %s): renewing the link",
                        link.address, msg.code, msg.message)
            link.stale = link.stale or f"it answered {msg.code} naming no request"

    def _on_hello_ack(self, link: _PrefillLink, msg: HelloAck) -> None:
        if not msg.ok:
            self._refuse(link, msg.reason)
            return
        link.peer_incarnation = msg.incarnation
        known = self._incarnations.get(link.address)
        if msg.incarnation:
            self._incarnations[link.address] = msg.incarnation
        if known and msg.incarnation and known != msg.incarnation:
            log.warning("prefill engine at %s restarted (incarnation %s, then %s)", link.address, known,
                        msg.incarnation)
            self._restarted_at[link.address] = max(self._restarted_at.get(link.address, 0), link.serial)
            self._fail_older(link, f"the prefill engine at {link.address} restarted: its KV for this request is gone")

    def _renew(self, link: _PrefillLink) -> None:
        """Replace a stale link with a new one (new socket, new Hello); what the engine there refused for want
        of a Hello goes again, once; every other transfer asked on an older link fails now (and is aborted there,
        so the blocks of a prompt the new engine did compute go too)."""
        log.warning("the KV link to prefill engine %s is stale (%s): opening a new one", link.address, link.stale)
        link.close()
        del self._links[link.address]
        self._incarnations.pop(link.address, None)
        try:
            new = self._link(link.address)
        except WireError as exc:
            for incoming in self._asked_before(link, including=True):
                self._fail(incoming, f"cannot reach prefill engine {link.address} again: {exc}")
            return
        self._restarted_at[link.address] = new.serial
        for incoming in self._asked_before(new):
            if incoming.request_id in link.refused_for_hello and not incoming.resent:
                incoming.resent = True
                self._want(new, incoming)
        for request_id, (address, serial) in list(self._held.items()):
            if address == link.address and serial < new.serial and request_id in link.refused_for_hello:
                self._held[request_id] = (address, new.serial)
                self._queue(new, KVHold(request_id=request_id))
        self._fail_older(new, f"the KV link to {link.address} went stale ({link.stale}): "
                              "its KV for this request is gone")

    def _asked_before(self, link: _PrefillLink, including: bool = False) -> list[IncomingTransfer]:
        """The transfers still receiving at link's address whose KVWant went on an older link (or on it too)."""
        return [incoming for incoming in self.transfers.values()
                if incoming.address == link.address and incoming.state is IncomingState.RECEIVING
                and (incoming.link_serial < link.serial or including and incoming.link_serial == link.serial)]

    def _fail_older(self, link: _PrefillLink, reason: str) -> None:
        """Fail the transfers asked on links older than `link`, and abort them on it (the engine there frees
        whatever it computed for them)."""
        for incoming in self._asked_before(link):
            self._fail(incoming, reason)
            self._queue(link, Abort(request_id=incoming.request_id, reason="asked of a previous incarnation"))

    def _follow_routers(self) -> None:
        """Say Hello to every trusted prefill engine once, before any request names it: a prefill engine learns
        from it that this engine restarted. A router announced a new incarnation at an address this engine has a
        link to: renew the link now, before a request finds it stale."""
        if self.kv_peers is None:
            return
        for address in self.kv_peers.addresses() - self._greeted:
            self._greeted.add(address)
            try:
                self._link(address)
            except WireError as exc:
                log.info("no KV link to prefill engine %s yet: %s", address, exc)
        for address, link in list(self._links.items()):
            announced = self.kv_peers.incarnation(address)
            if not announced or announced == self._announced.get(address):
                continue
            self._announced[address] = announced
            if link.peer_incarnation and link.peer_incarnation != announced:
                link.stale = f"the router lists incarnation {announced} there, the link reached {link.peer_incarnation}"
                self._renew(link)

    def _refuse(self, link: _PrefillLink, reason: str) -> None:
        log.error("prefill engine %s refused the KV link: %s", link.address, reason)
        link.refused = reason
        for incoming in list(self.transfers.values()):
            if incoming.address == link.address and incoming.state is IncomingState.RECEIVING:
                self._fail(incoming, f"prefill engine refused the KV link: {reason}")
                self._send_quietly(link, Abort(request_id=incoming.request_id, reason="KV link refused"))

    def _receiving(self, request_id: str, link: _PrefillLink) -> IncomingTransfer | None:
        """The transfer still receiving for request_id, if it was asked for on this link (KV or news
        about a request from any other prefill engine is not taken)."""
        incoming = self.transfers.get(request_id)
        if incoming is None or incoming.state is not IncomingState.RECEIVING or incoming.address != link.address:
            return None
        return incoming

    def _on_layer(self, link: _PrefillLink, msg: KVLayer, frame) -> None:
        incoming = self._receiving(msg.request_id, link)
        if incoming is None:
            log.warning("KV for unknown request %s from %s dropped", msg.request_id, link.address)
            return
        problem = self.writer.layer_problem(incoming, msg)
        if problem:
            self._fail(incoming, problem, ack_to=link)
            return
        self.writer.write(incoming, msg, msg.tensor(frame))
        for layer in range(msg.layer_start, msg.layer_end):
            incoming.layer_tokens_received[layer] += msg.num_tokens
        incoming.checksums.append(msg.checksum)
        self.stats.kv_bytes_received += msg.nbytes

    def _on_done(self, link: _PrefillLink, msg: KVDone) -> None:
        incoming = self._receiving(msg.request_id, link)
        if incoming is None:
            log.warning("KVDone for unknown request %s from %s dropped", msg.request_id, link.address)
            return
        end = incoming.skip_tokens + incoming.num_tokens
        expected = LinkLayout.num_tokens_per_layer(incoming.first_positions, end)
        if incoming.layer_tokens_received != expected or msg.num_tokens != incoming.num_tokens:
            self._fail(incoming, f"KV incomplete: {_short_diff(incoming.layer_tokens_received, expected)}",
                       ack_to=link)
        elif combine_checksums(incoming.checksums) != msg.checksum:
            self._fail(incoming, "KV checksum over all layers does not match: a message was lost, "
                                 "repeated or reordered", ack_to=link)
        else:
            incoming.received(msg.first_token, msg.first_logprobs)
            log.debug("KV of %s verified at %.6f", msg.request_id, time.time())
            self.stats.num_kv_transfers += 1
            self.stats.kv_transfer_seconds += time.monotonic() - incoming.started
            self._send_quietly(link, KVAck(request_id=msg.request_id, ok=True))

    # ---- failures ----

    def _fail_id(self, request_id: str, reason: str, link: _PrefillLink, ack: bool = False) -> None:
        self._held.pop(request_id, None)
        incoming = self._receiving(request_id, link)
        if incoming is not None:
            self._fail(incoming, reason, ack_to=link if ack else None)

    def _fail(self, incoming: IncomingTransfer, reason: str, ack_to: _PrefillLink | None = None) -> None:
        log.warning("remote prefill of %s failed: %s", incoming.request_id, reason)
        self.stats.num_kv_transfers_failed += 1
        incoming.fail(reason)
        if ack_to is not None:  # the prefill engine may free its blocks now
            self._send_quietly(ack_to, KVAck(request_id=incoming.request_id, ok=False, reason=reason[:4000]))

    def prompt_computed(self, request_id: str) -> None:
        """The prefill engine has computed the request's prompt (the router relayed its first token):
        the KV now has timeout_s from here, however long the prompt waited in that engine's queue."""
        incoming = self.transfers.get(request_id)
        if incoming is not None and incoming.state is IncomingState.RECEIVING and incoming.computed_at is None:
            incoming.computed_at = time.monotonic()

    def _expire(self) -> None:
        now = time.monotonic()
        for incoming in list(self.transfers.values()):
            if incoming.state is not IncomingState.RECEIVING:
                continue
            if incoming.computed_at is None and now - incoming.started > self.queue_timeout_s:
                reason = (f"the prefill engine at {incoming.address} did not compute the prompt within "
                          f"{self.queue_timeout_s:g}s of the KVWant (--kv-queue-timeout)")
            elif incoming.computed_at is not None and now - incoming.computed_at > self.timeout_s:
                reason = (f"no complete KV from {incoming.address} within {self.timeout_s:g}s of the prompt "
                          f"being computed (--kv-timeout)")
            else:
                continue
            self.abort(incoming, "KV timed out on decode")
            self._fail(incoming, reason)

    def _send_quietly(self, link: _PrefillLink, msg) -> None:
        """Never waits: a message for a prefill engine that is gone or not reading is dropped, so aborting
        many requests on a dead link cannot stall decoding."""
        try:
            link.client.send(msg, timeout=0)
        except WireError as exc:  # the peer is gone; our side is already cleaned up
            log.info("could not send %s to %s: %s", msg.type_name, link.address, exc)


def _short_diff(received: list[int], expected: list[int]) -> str:
    """ "layer 3: 12 of 16 tokens arrived (and 2 more layers)": the first layer that is short or over """
    wrong = [layer for layer, (got, want) in enumerate(zip(received, expected)) if got != want]
    if not wrong:
        return "every layer arrived, but KVDone counts another number of tokens"
    layer = wrong[0]
    more = f" (and {len(wrong) - 1} more layers)" if len(wrong) > 1 else ""
    return f"layer {layer}: {received[layer]} of {expected[layer]} tokens arrived{more}"
