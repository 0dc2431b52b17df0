"""Decode-role KV connector: asks prefill engines for the KV of prompts it has allocated, writes the
frames straight into those blocks, verifies them, and tells the scheduler when a request can decode.

One DEALER link per prefill engine (opened on first use, Hello + fingerprint first). Everything runs
on the engine's loop thread: `receive()` drains the links between steps, `poll()` reports events.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pdserve import kernels
from pdserve.control.errors import ProtocolError, WireError
from pdserve.control.keys import CurveClientConfig
from pdserve.control.messages import Abort, Error
from pdserve.control.sockets import ClientSocket
from pdserve.engine.cpu_threads import one_cpu_thread
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector
from pdserve.engine.request import Request
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVDone, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums

log = logging.getLogger("pdserve.decode.connector")

SEND_TIMEOUT_S = 2.0


@dataclass
class _PrefillLink:
    address: str
    client: ClientSocket
    refused: str | None = None  # why the prefill engine refused the link (layout mismatch ...)


@dataclass
class _Incoming:
    """A request whose prompt KV is on its way: tokens [skip_tokens, skip_tokens + num_tokens)."""

    request: Request
    block_ids: torch.Tensor  # [num_blocks] int64, all of the request's blocks
    skip_tokens: int
    num_tokens: int
    link: _PrefillLink
    deadline: float
    started: float = field(default_factory=time.monotonic)  # when the KVWant went out
    layer_tokens_received: int = 0  # sum over KVLayer messages of layers x tokens
    checksums: list[int] = field(default_factory=list)


class DecodeConnector(KVConnector):
    def __init__(self, fingerprint: LayoutFingerprint, engine_id: str, timeout_s: float = 30.0,
                 curve: CurveClientConfig | None = None) -> None:
        self.fingerprint = fingerprint
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.curve = curve
        self.kv_cache: torch.Tensor | None = None  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self._links: dict[str, _PrefillLink] = {}
        self._incoming: dict[str, _Incoming] = {}
        self._events = ConnectorEvents()
        self.bytes_received = 0
        self.num_failed = 0
        self.num_transfers = 0  # completed, with their summed latency (KVWant sent -> KVDone verified)
        self.transfer_seconds = 0.0

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def sockets(self) -> list:
        return [link.client.socket for link in self._links.values()]

    # ---- scheduler hooks ----

    def num_external_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        if request.prefill_kv_address is None:
            return 0
        return request.num_prompt_tokens - num_local_hit_tokens

    def on_blocks_allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        skip = request.num_computed_tokens  # the local prefix hit, block aligned
        try:
            link = self._link(request.prefill_kv_address)
            incoming = _Incoming(request, torch.tensor(block_ids, dtype=torch.int64), skip, num_external_tokens,
                                 link, time.monotonic() + self.timeout_s)
            self._incoming[request.request_id] = incoming
            link.client.send(KVWant(request_id=request.request_id, skip_tokens=skip, num_tokens=num_external_tokens),
                             timeout=SEND_TIMEOUT_S)
        except WireError as exc:
            self._fail(request.request_id, f"cannot reach prefill engine {request.prefill_kv_address}: {exc}")

    def on_request_aborted(self, request: Request) -> None:
        incoming = self._incoming.pop(request.request_id, None)
        if incoming is not None:
            self._send_quietly(incoming.link, Abort(request_id=request.request_id, reason="aborted on decode"))

    def poll(self) -> ConnectorEvents:
        self._expire()
        events, self._events = self._events, ConnectorEvents()
        return events

    # ---- links ----

    def _link(self, address: str) -> _PrefillLink:
        link = self._links.get(address)
        if link is None:
            client = ClientSocket(address, curve=self.curve, send_timeout=SEND_TIMEOUT_S)
            link = _PrefillLink(address, client)
            self._links[address] = link
            client.send(Hello(fingerprint=self.fingerprint.to_dict(), role="decode", engine_id=self.engine_id))
        if link.refused:
            raise KVTransferError(f"the link was refused: {link.refused}")
        return link

    def receive(self) -> None:
        """Handle every message waiting on any link (call between steps)."""
        for link in list(self._links.values()):
            while True:
                try:
                    received = link.client.recv(timeout=0)
                except ProtocolError as exc:
                    log.warning("bad message from %s: %s", link.address, exc)
                    if exc.request_id:
                        self._fail(exc.request_id, f"bad KV message: {exc}", ack_to=link)
                    continue
                if received is None:
                    break
                self._dispatch(link, received.msg, received.frames)

    def _dispatch(self, link: _PrefillLink, msg, frames) -> None:
        if isinstance(msg, HelloAck):
            if not msg.ok:
                self._refuse(link, msg.reason)
        elif isinstance(msg, KVLayer):
            self._on_layer(link, msg, frames[0])
        elif isinstance(msg, KVDone):
            self._on_done(link, msg)
        elif isinstance(msg, Error) and msg.request_id:
            self._fail(msg.request_id, f"prefill engine error: {msg.message}")
        elif isinstance(msg, Abort):
            self._fail(msg.request_id, f"prefill engine aborted: {msg.reason}")
        else:
            log.warning("unexpected %s from %s ignored", msg.type_name, link.address)

    def _refuse(self, link: _PrefillLink, reason: str) -> None:
        log.error("prefill engine %s refused the KV link: %s", link.address, reason)
        link.refused = reason
        for request_id, incoming in list(self._incoming.items()):
            if incoming.link is link:
                self._fail(request_id, f"prefill engine refused the KV link: {reason}")
                self._send_quietly(link, Abort(request_id=request_id, reason="KV link refused"))

    # ---- KV payloads ----

    def _on_layer(self, link: _PrefillLink, msg: KVLayer, frame) -> None:
        incoming = self._incoming.get(msg.request_id)
        if incoming is None:
            log.warning("KV for unknown request %s from %s dropped", msg.request_id, link.address)
            return
        problem = self._layer_problem(incoming, msg)
        if problem:
            self._fail(msg.request_id, problem, ack_to=link)
            return
        self._write(incoming, msg, msg.tensor(frame))
        incoming.layer_tokens_received += (msg.layer_end - msg.layer_start) * msg.num_tokens
        incoming.checksums.append(msg.checksum)
        self.bytes_received += msg.nbytes

    def _layer_problem(self, incoming: _Incoming, msg: KVLayer) -> str | None:
        num_layers, _, _, _, num_kv_heads, head_dim = self.kv_cache.shape
        expected_dtype = str(self.kv_cache.dtype).removeprefix("torch.")
        if msg.layer_end > num_layers:
            return f"KV for layers up to {msg.layer_end}, the model has {num_layers}"
        if msg.token_start + msg.num_tokens > incoming.num_tokens:
            return f"KV for tokens up to {msg.token_start + msg.num_tokens}, only {incoming.num_tokens} were asked for"
        if tuple(msg.shape[3:]) != (num_kv_heads, head_dim) or msg.dtype != expected_dtype:
            return f"KV of shape {list(msg.shape)} {msg.dtype}, expected [.., {num_kv_heads}, {head_dim}] {expected_dtype}"
        return None

    def _write(self, incoming: _Incoming, msg: KVLayer, kv: torch.Tensor) -> None:
        """kv [num_layers, 2, T, kv_heads, head_dim] -> the request's blocks at its token positions."""
        device, block_size = self.kv_cache.device, self.kv_cache.shape[3]
        first = incoming.skip_tokens + msg.token_start  # prompt position of the message's first token
        kv = kv.to(device, non_blocking=True)
        with one_cpu_thread(device):
            if first % block_size == 0:  # starts on a block boundary: one scatter for all its layers
                blocks = incoming.block_ids[first // block_size:].to(device)
                kernels.kv_unpack(kv, self.kv_cache, blocks, msg.num_tokens, msg.layer_start)
                return
            positions = first + torch.arange(msg.num_tokens)  # a chunk that starts mid-block
            slots = (incoming.block_ids[positions // block_size] * block_size + positions % block_size).to(device)
            for offset in range(msg.layer_end - msg.layer_start):
                layer = self.kv_cache[msg.layer_start + offset]
                kernels.store_kv(kv[offset, 0], kv[offset, 1], layer[0], layer[1], slots)

    def _on_done(self, link: _PrefillLink, msg: KVDone) -> None:
        incoming = self._incoming.get(msg.request_id)
        if incoming is None:
            log.warning("KVDone for unknown request %s from %s dropped", msg.request_id, link.address)
            return
        expected = self.kv_cache.shape[0] * incoming.num_tokens
        if incoming.layer_tokens_received != expected or msg.num_tokens != incoming.num_tokens:
            self._fail(msg.request_id, f"KV incomplete: {incoming.layer_tokens_received} of {expected} "
                                       "layer-tokens arrived", ack_to=link)
        elif combine_checksums(incoming.checksums) != msg.checksum:
            self._fail(msg.request_id, "KV checksum over all layers does not match: a message was lost, "
                                       "repeated or reordered", ack_to=link)
        else:
            del self._incoming[msg.request_id]
            self.num_transfers += 1
            self.transfer_seconds += time.monotonic() - incoming.started
            self._events.received[msg.request_id] = (msg.first_token, msg.first_logprobs)
            self._send_quietly(link, KVAck(request_id=msg.request_id, ok=True))

    # ---- failures ----

    def _fail(self, request_id: str, reason: str, ack_to: _PrefillLink | None = None) -> None:
        incoming = self._incoming.pop(request_id, None)
        if incoming is None:
            return
        log.warning("remote prefill of %s failed: %s", request_id, reason)
        self.num_failed += 1
        self._events.failed[request_id] = reason
        if ack_to is not None:  # the prefill engine may free its blocks now
            self._send_quietly(ack_to, KVAck(request_id=request_id, ok=False, reason=reason[:4000]))

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, incoming in list(self._incoming.items()):
            if now > incoming.deadline:
                self._send_quietly(incoming.link, Abort(request_id=request_id, reason="KV timed out on decode"))
                self._fail(request_id, f"no complete KV from {incoming.link.address} within {self.timeout_s:g}s")

    def _send_quietly(self, link: _PrefillLink, msg) -> None:
        try:
            link.client.send(msg, timeout=0.1)
        except WireError as exc:  # the peer is gone; our side is already cleaned up
            log.info("could not send %s to %s: %s", msg.type_name, link.address, exc)

    def close(self) -> None:
        for link in self._links.values():
            link.client.close()
