"""Prefill-role KV connector: serves decode engines' KVWant for prompts this engine prefilled.

A finished prefill keeps its blocks (delayed free) until the decode engine that asked for them acks,
or until a bound passes: no KVWant within `want_timeout_s`, or no KVAck within `lease_s` (the decode
engine died). A KVWant may arrive before the prompt is computed; it waits for it, within the bound.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch

import kernels
from engine.kv_connector import ConnectorEvents, KVConnector
from engine.request import Request, RequestStatus
from kvtransfer.errors import KVTransferError, LayoutMismatchError, ProtocolError
from kvtransfer.fingerprint import LayoutFingerprint, check_compatible
from kvtransfer.protocol import Abort, Error, Hello, HelloAck, KVAck, KVDone, KVLayer, KVWant, combine_checksums
from kvtransfer.transport import KVServer

log = logging.getLogger("pdserve.prefill.connector")

MESSAGE_TARGET_BYTES = 4 << 20  # group layers so each KVLayer frame is about this big (fewer, larger sends)
# Test-only fault injection: "drop:N", "corrupt:N", "stall:N" (hang) or "delay:N" (2 s) acts on the
# N-th KVLayer message this engine sends.
FAULT_ENV = "PDSERVE_FAULT_INJECT"


@dataclass
class _Prefilled:
    request: Request
    block_ids: list[int]
    done_at: float


@dataclass
class _Want:
    peer_id: bytes
    skip_tokens: int
    num_tokens: int
    at: float


class PrefillConnector(KVConnector):
    def __init__(self, server: KVServer, fingerprint: LayoutFingerprint, want_timeout_s: float = 30.0,
                 lease_s: float = 30.0) -> None:
        self.server = server
        self.fingerprint = fingerprint
        self.want_timeout_s = want_timeout_s
        self.lease_s = lease_s
        self.kv_cache: torch.Tensor | None = None  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self._peers: set[bytes] = set()  # decode engines whose Hello was accepted
        self._prefilled: dict[str, _Prefilled] = {}  # finished, waiting for a KVWant
        self._wants: dict[str, _Want] = {}  # KVWant that came before the prefill finished
        self._awaiting_ack: dict[str, float] = {}  # request id -> lease deadline
        self._events = ConnectorEvents()
        self.aborted_by_peer: list[str] = []  # the service aborts these in its engine
        self.bytes_sent = 0
        self._messages_sent = 0
        self._fault = _parse_fault(os.environ.get(FAULT_ENV, ""))

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def sockets(self) -> list:
        return [self.server.socket]

    # ---- scheduler hooks ----

    def on_request_finished(self, request: Request, block_ids: list[int]) -> bool:
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            self._wants.pop(request.request_id, None)
            return False
        self._prefilled[request.request_id] = _Prefilled(request, block_ids, time.monotonic())
        self._try_send(request.request_id)
        return True

    def poll(self) -> ConnectorEvents:
        self._expire()
        events, self._events = self._events, ConnectorEvents()
        return events

    # ---- incoming ----

    def receive(self) -> None:
        while True:
            try:
                routed = self.server.recv(timeout=0)
            except ProtocolError as exc:
                log.warning("bad message on the KV link: %s", exc)
                self._reply(exc.peer_id, Error.from_exception(exc))
                continue
            if routed is None:
                return
            self._dispatch(routed.peer_id, routed.msg)

    def _dispatch(self, peer_id: bytes, msg) -> None:
        if isinstance(msg, Hello):
            self._on_hello(peer_id, msg)
        elif isinstance(msg, Abort):  # freeing is harmless, so any peer may ask for it
            self._on_abort(msg.request_id)
        elif peer_id not in self._peers:
            self._reply(peer_id, Error(code="no_hello", message="say Hello with your layout fingerprint first"))
        elif isinstance(msg, KVWant):
            self._on_want(peer_id, msg)
        elif isinstance(msg, KVAck):
            self._release(msg.request_id, "acked" if msg.ok else f"nacked: {msg.reason}")
        else:
            self._reply(peer_id, Error(code="unexpected", message=f"{msg.type_name} is not served on the KV link"))

    def _on_hello(self, peer_id: bytes, msg: Hello) -> None:
        try:
            check_compatible(self.fingerprint, LayoutFingerprint.from_dict(msg.fingerprint))
        except (LayoutMismatchError, ProtocolError) as exc:
            log.error("refused KV link from %s: %s", msg.engine_id, exc)
            self._reply(peer_id, HelloAck(ok=False, reason=str(exc)[:4000]))
            return
        self._peers.add(peer_id)
        self._reply(peer_id, HelloAck(ok=True))

    def _on_want(self, peer_id: bytes, msg: KVWant) -> None:
        self._wants[msg.request_id] = _Want(peer_id, msg.skip_tokens, msg.num_tokens, time.monotonic())
        self._try_send(msg.request_id)

    def _on_abort(self, request_id: str) -> None:
        if not self.abort(request_id):
            self.aborted_by_peer.append(request_id)  # still computing: the service aborts it

    def abort(self, request_id: str) -> bool:
        """Forget a request; True if it was finished here (its blocks are released now)."""
        self._wants.pop(request_id, None)
        if request_id in self._prefilled or request_id in self._awaiting_ack:
            self._release(request_id, "aborted")
            return True
        return False

    # ---- sending ----

    def _try_send(self, request_id: str) -> None:
        if request_id not in self._prefilled or request_id not in self._wants:
            return
        prefilled, want = self._prefilled.pop(request_id), self._wants.pop(request_id)
        self._awaiting_ack[request_id] = time.monotonic() + self.lease_s
        problem = self._want_problem(prefilled, want)
        if problem:
            self._reply(want.peer_id, Error(code="bad_want", message=problem, request_id=request_id))
            self._release(request_id, problem)
            return
        try:
            self._send_kv(prefilled, want)
        except KVTransferError as exc:
            log.warning("sending KV of %s failed: %s", request_id, exc)
            self._release(request_id, str(exc))

    def _want_problem(self, prefilled: _Prefilled, want: _Want) -> str | None:
        block_size = self.kv_cache.shape[3]
        num_prompt = prefilled.request.num_prompt_tokens
        if want.skip_tokens % block_size or want.skip_tokens + want.num_tokens != num_prompt:
            return (f"KVWant for tokens [{want.skip_tokens}, {want.skip_tokens + want.num_tokens}) does not fit "
                    f"the {num_prompt}-token prompt in blocks of {block_size}")
        return None

    def _send_kv(self, prefilled: _Prefilled, want: _Want) -> None:
        request_id = prefilled.request.request_id
        block_size, num_layers = self.kv_cache.shape[3], self.kv_cache.shape[0]
        block_ids = torch.tensor(prefilled.block_ids[want.skip_tokens // block_size:], dtype=torch.int64,
                                 device=self.kv_cache.device)
        per_layer = self.kv_cache[0, :, 0, 0].numel() * want.num_tokens * self.kv_cache.element_size()
        step = max(1, min(num_layers, math.ceil(MESSAGE_TARGET_BYTES / per_layer)))
        checksums = []
        for layer_start in range(0, num_layers, step):
            kv = kernels.kv_pack(self.kv_cache, block_ids, want.num_tokens, layer_start,
                                 min(num_layers, layer_start + step)).cpu()  # [layers, 2, T, kv_heads, head_dim]
            msg, payload = KVLayer.from_tensor(kv, request_id=request_id, layer_start=layer_start, token_start=0)
            checksums.append(msg.checksum)
            self._send_layer(want.peer_id, msg, payload)
        first = prefilled.request
        self.server.send(want.peer_id, KVDone(
            request_id=request_id, first_token=first.output_token_ids[0], num_tokens=want.num_tokens,
            checksum=combine_checksums(checksums), first_logprobs=first.logprobs[0] if first.logprobs else None))

    def _send_layer(self, peer_id: bytes, msg: KVLayer, payload: memoryview) -> None:
        index, self._messages_sent = self._messages_sent, self._messages_sent + 1
        action = self._fault.get(index)
        if action == "drop":
            return
        if action == "corrupt":
            payload = bytearray(payload)
            payload[len(payload) // 2] ^= 0x40
        if action == "delay":
            time.sleep(2.0)
        if action == "stall":
            log.error("fault injection: stalling forever mid-transfer")
            while True:
                time.sleep(3600)
        self.server.send(peer_id, msg, payload)
        self.bytes_sent += msg.nbytes

    # ---- freeing ----

    def _release(self, request_id: str, why: str) -> None:
        """Let the scheduler free the request's blocks (delayed free ends)."""
        held = self._prefilled.pop(request_id, None) is not None
        held = self._awaiting_ack.pop(request_id, None) is not None or held
        if held:
            log.debug("releasing blocks of %s: %s", request_id, why)
            self._events.sent.add(request_id)

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, prefilled in list(self._prefilled.items()):
            if now - prefilled.done_at > self.want_timeout_s:
                self._release(request_id, f"no KVWant within {self.want_timeout_s:g}s")
        for request_id, deadline in list(self._awaiting_ack.items()):
            if now > deadline:
                self._release(request_id, f"no KVAck within the {self.lease_s:g}s lease")
        for request_id, want in list(self._wants.items()):
            if now - want.at > self.want_timeout_s:
                del self._wants[request_id]
                self._reply(want.peer_id, Error(code="unknown_request", request_id=request_id,
                                                message="this prefill engine never received that prompt"))

    def close(self) -> None:
        self.server.close()

    def _reply(self, peer_id: bytes | None, msg) -> None:
        if peer_id is None:
            return
        try:
            self.server.send(peer_id, msg, timeout=0.1)
        except KVTransferError as exc:
            log.info("could not answer %s: %s", peer_id.hex(), exc)


def _parse_fault(spec: str) -> dict[int, str]:
    """"drop:3,corrupt:5" -> {3: "drop", 5: "corrupt"}; empty in production."""
    faults = {}
    for item in filter(None, spec.split(",")):
        action, _, index = item.partition(":")
        if action not in ("drop", "corrupt", "stall", "delay") or not index.isdigit():
            raise ValueError(f"{FAULT_ENV}={spec!r}: use comma-separated drop:N, corrupt:N, stall:N or delay:N")
        faults[int(index)] = action
    return faults
