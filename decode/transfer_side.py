"""Decode role, transfer side: the links to prefill engines. Asks for a prompt's KV, writes the frames
straight into the blocks the scheduler allocated, verifies them and acks.

One DEALER link per prefill engine (opened on first use, Hello + fingerprint first). Everything runs on
the engine loop's thread and nothing on it waits for a peer: what a link cannot take yet (it is still
connecting) waits in the link's outbox, `receive()` retries it between steps, and a link that takes
nothing for CONNECT_TIMEOUT_S fails the transfers waiting on it (they are recomputed or fail) and is
dropped. `receive()` also drains the links and ends transfers that timed out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pdserve.decode.incoming import IncomingState, IncomingTransfer
from pdserve.decode.kv_writer import KVWriter
from pdserve.engine.kv_connector import KVTransferSide
from pdserve.control.errors import ProtocolError, WireError
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.control.messages import Abort, Error
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVDone, KVHold, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums
from pdserve.control.keys import CurveClientConfig
from pdserve.control.sockets import ClientSocket

log = logging.getLogger("pdserve.decode.transfer_side")

CONNECT_TIMEOUT_S = 2.0  # a message a link has not taken by then fails its transfer


@dataclass
class _Outgoing:
    msg: Hello | KVHold | KVWant
    incoming: IncomingTransfer | None  # the transfer a KVWant asks for
    queued: float  # time.monotonic()


@dataclass
class _PrefillLink:
    address: str
    client: ClientSocket
    refused: str | None = None  # why the prefill engine refused the link (layout mismatch ...)
    outbox: deque[_Outgoing] = field(default_factory=deque)  # not taken yet, in order


class DecodeTransferSide(KVTransferSide):
    def __init__(self, fingerprint: LayoutFingerprint, engine_id: str, timeout_s: float = 30.0,
                 curve: CurveClientConfig | None = None, queue_timeout_s: float = 600.0) -> None:
        super().__init__()
        self.fingerprint = fingerprint
        self.engine_id = engine_id
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

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.writer = KVWriter(kv_cache)  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]

    def sockets(self) -> list:
        return [link.client.socket for link in self._links.values()]

    def close(self) -> None:
        for link in self._links.values():
            link.client.close()

    # ---- asked by the scheduler side ----

    def hold(self, request_id: str, address: str) -> None:
        """Tell the prefill engine at `address` that the request is queued here (KVHold): it keeps the
        computed prompt's KV until this engine has blocks for it and asks, rather than --kv-want-timeout."""
        try:
            link = self._link(address)
        except WireError:
            return  # the KVWant will fail the same way, and say why
        link.outbox.append(_Outgoing(KVHold(request_id=request_id), None, time.monotonic()))
        self._flush(link)

    def ask(self, incoming: IncomingTransfer) -> None:
        """Send the KVWant (opening the link first if this is its first request), without waiting."""
        try:
            link = self._link(incoming.address)
        except KVTransferError as exc:  # refused already: the same reason as the transfers it failed then
            self._fail(incoming, str(exc))
            return
        except WireError as exc:
            self._fail(incoming, f"cannot reach prefill engine {incoming.address}: {exc}")
            return
        want = KVWant(request_id=incoming.request_id, skip_tokens=incoming.skip_tokens, num_tokens=incoming.num_tokens)
        link.outbox.append(_Outgoing(want, incoming, time.monotonic()))
        self._flush(link)

    def abort(self, incoming: IncomingTransfer, reason: str) -> None:
        """Tell the prefill engine to stop and free its side (a KVWant it never took is withdrawn)."""
        link = self._links.get(incoming.address)
        if link is not None:
            link.outbox = deque(item for item in link.outbox if item.incoming is not incoming)
            self._send_quietly(link, Abort(request_id=incoming.request_id, reason=reason))

    def _link(self, address: str) -> _PrefillLink:
        link = self._links.get(address)
        if link is None:
            # no KVLayer frame can be larger than our whole cache: a bigger one drops the link
            client = ClientSocket(address, curve=self.curve, max_message_bytes=self.writer.kv_cache.nbytes)
            link = _PrefillLink(address, client)
            self._links[address] = link
            hello = Hello(fingerprint=self.fingerprint.to_dict(), role="decode", engine_id=self.engine_id)
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
        link.client.close()
        del self._links[link.address]

    # ---- incoming ----

    def receive(self) -> None:
        """Send what links can take now, handle every message waiting on any link, then end the transfers
        that timed out."""
        for link in list(self._links.values()):
            self._flush(link)
            if link.address not in self._links:
                continue
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
        self._expire()

    def _dispatch(self, link: _PrefillLink, msg, frames) -> None:
        if isinstance(msg, HelloAck):
            if not msg.ok:
                self._refuse(link, msg.reason)
        elif isinstance(msg, KVLayer):
            self._on_layer(link, msg, frames[0])
        elif isinstance(msg, KVDone):
            self._on_done(link, msg)
        elif isinstance(msg, Error) and msg.request_id:
            self._fail_id(msg.request_id, f"prefill engine error: {msg.message}", link)
        elif isinstance(msg, Abort):
            self._fail_id(msg.request_id, f"prefill engine aborted: {msg.reason}", link)
        else:
            log.warning("unexpected %s from %s ignored", msg.type_name, link.address)

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
        incoming.layer_tokens_received += (msg.layer_end - msg.layer_start) * msg.num_tokens
        incoming.checksums.append(msg.checksum)
        self.stats.kv_bytes_received += msg.nbytes

    def _on_done(self, link: _PrefillLink, msg: KVDone) -> None:
        incoming = self._receiving(msg.request_id, link)
        if incoming is None:
            log.warning("KVDone for unknown request %s from %s dropped", msg.request_id, link.address)
            return
        expected = self.writer.kv_cache.shape[0] * incoming.num_tokens
        if incoming.layer_tokens_received != expected or msg.num_tokens != incoming.num_tokens:
            self._fail(incoming, f"KV incomplete: {incoming.layer_tokens_received} of {expected} "
                                 "layer-tokens arrived", ack_to=link)
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
