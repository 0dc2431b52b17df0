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
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pdserve import kernels
from pdserve.control.errors import ProtocolError, WireError
from pdserve.control.messages import Abort, Error
from pdserve.control.sockets import ServerSocket
from pdserve.engine.cpu_threads import one_cpu_thread
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvtransfer.errors import LayoutMismatchError
from pdserve.kvtransfer.fingerprint import LayoutFingerprint, check_compatible
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVDone, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums

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
class _Transfer:
    """A decode engine's KVWant: prompt tokens [skip_tokens, skip_tokens + num_tokens) go to peer_id."""

    peer_id: bytes
    skip_tokens: int
    num_tokens: int
    at: float
    sent_upto: int  # every layer of the tokens before this position has been sent
    checksums: list[int] = field(default_factory=list)
    checked: bool = False


@dataclass
class _StreamJob:
    """Prompt tokens [begin, end) that this step computes, streamed to transfer's peer per layer."""

    request_id: str
    transfer: _Transfer
    begin: int
    end: int
    slots: torch.Tensor  # [end - begin] int64 cache slots
    next_layer: int = 0  # layers below this one are sent


@dataclass
class _Copied:
    """A streamed layer range on its way to host memory, sent once `ready` has passed (None: already
    on the host). On CUDA the device-to-host copy runs beside the forward instead of stopping it."""

    request_id: str
    transfer: _Transfer
    layer_start: int
    position: int  # prompt position of its first token
    kv: torch.Tensor  # [layers, 2, T, kv_heads, head_dim] on the CPU (pinned when it comes from CUDA)
    ready: Any = None  # torch.cuda.Event recorded after the copy


@dataclass
class _AwaitingAck:
    deadline: float  # the lease: blocks are freed then even without an ack
    computed_at: float  # when the prompt's last layer was computed


class PrefillConnector(KVConnector):
    def __init__(self, server: ServerSocket, fingerprint: LayoutFingerprint, want_timeout_s: float = 30.0,
                 lease_s: float = 30.0, stream_layers: bool = True) -> None:
        self.server = server
        self.fingerprint = fingerprint
        self.want_timeout_s = want_timeout_s
        self.lease_s = lease_s
        self.stream_layers = stream_layers
        self.kv_cache: torch.Tensor | None = None  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self._peers: set[bytes] = set()  # decode engines whose Hello was accepted
        self._prefilled: dict[str, _Prefilled] = {}  # finished, waiting for a KVWant
        self._transfers: dict[str, _Transfer] = {}  # asked for, not completely sent
        self._awaiting_ack: dict[str, _AwaitingAck] = {}
        self._events = ConnectorEvents()
        self.aborted_by_peer: list[str] = []  # the service aborts these in its engine
        self.bytes_sent = 0
        # Acked transfers and their summed exposed time: prompt computed -> KVAck received, i.e. the
        # part of the transfer that layer-wise streaming did not hide behind compute.
        self.num_transfers = 0
        self.transfer_seconds = 0.0
        self._messages_sent = 0
        self._copies: deque[_Copied] = deque()  # streamed layers not sent yet, in send order
        self._copy_stream = None  # CUDA: the side stream of the device-to-host copies, made on first use
        self._fault = _parse_fault(os.environ.get(FAULT_ENV, ""))

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def sockets(self) -> list:
        return [self.server.socket]

    # ---- scheduler hooks ----

    def on_request_finished(self, request: Request, block_ids: list[int]) -> bool:
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            self._transfers.pop(request.request_id, None)
            return False
        self._prefilled[request.request_id] = _Prefilled(request, block_ids, time.monotonic())
        self._try_finish(request.request_id)
        return True

    def poll(self) -> ConnectorEvents:
        self._send_copied(wait=True)  # between steps: nothing streamed may linger
        self._expire()
        events, self._events = self._events, ConnectorEvents()
        return events

    def layer_hook(self, plan) -> Callable[[int], None] | None:
        """Stream this step's new prompt KV to the decode engines that asked, each layer as soon as it
        is stored. A KVWant that arrives while the step runs is picked up at the next layer boundary
        (the socket is read between layers); the layers stored before it go in one catch-up message."""
        if not self.stream_layers:
            return None
        prompt_items = [item for item in plan.scheduled
                        if item.request.num_computed_tokens < item.request.num_prompt_tokens]
        jobs: list[_StreamJob] = []
        unasked = []  # prompt chunks of this step whose KVWant has not come yet
        for item in prompt_items:
            transfer = self._transfers.get(item.request.request_id)
            if transfer is None:
                unasked.append(item)
            elif self._checked(item.request, transfer):
                self._start_streaming(item, transfer, jobs)
        if not jobs and not unasked:
            return None
        last_layer = self.kv_cache.shape[0] - 1

        def on_layer_stored(layer_idx: int) -> None:
            if unasked:
                self._pick_up_wants(unasked, jobs)
            for job in jobs:
                if self._transfers.get(job.request_id) is not job.transfer:  # aborted or failed meanwhile
                    continue
                self._copies.append(self._copy_to_host(job, layer_idx + 1))
                job.next_layer = layer_idx + 1
                if layer_idx == last_layer:  # queued in order: sent before anything else of this request
                    job.transfer.sent_upto = job.end
            self._send_copied(wait=False)
        return on_layer_stored

    def _copy_to_host(self, job: _StreamJob, layer_end: int) -> _Copied:
        """Layers [job.next_layer, layer_end) of this step's tokens, copied to the host. On CUDA the
        gather runs on the compute stream and the copy into pinned memory on a side stream, so it
        overlaps the next layers' kernels and the host never waits for it here."""
        kv = self._gather(job.next_layer, layer_end, job.slots)  # [layers, 2, T, kv_heads, head_dim]
        copied = _Copied(job.request_id, job.transfer, job.next_layer, job.begin, kv)
        if kv.device.type == "cuda":
            copied.kv, copied.ready = self._copy_on_side_stream(kv)
        return copied

    def _copy_on_side_stream(self, kv: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(pinned host copy of kv, event recorded when it has landed)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=kv.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(kv.device))  # kv is gathered by then
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        kv.record_stream(self._copy_stream)  # its memory is not reused before the side stream has read it
        return host, ready

    def _send_copied(self, wait: bool) -> None:
        """Send the streamed layers whose copy has landed, oldest first; with `wait`, all of them."""
        while self._copies:
            copied = self._copies[0]
            if copied.ready is not None and not copied.ready.query():
                if not wait:
                    return  # keep the order: later copies wait behind this one
                copied.ready.synchronize()
            self._copies.popleft()
            if self._transfers.get(copied.request_id) is not copied.transfer:  # aborted or failed meanwhile
                continue
            try:
                self._send_payload(copied.request_id, copied.transfer, copied.kv, copied.layer_start, copied.position)
            except WireError as exc:  # never fail the step (other requests share it)
                self._drop_transfer(copied.request_id, exc)

    def _pick_up_wants(self, unasked: list, jobs: list[_StreamJob]) -> None:
        """Read the KV socket mid-step; start streaming the chunks whose KVWant just came."""
        self.receive()
        for item in list(unasked):
            transfer = self._transfers.get(item.request.request_id)
            if transfer is not None:
                unasked.remove(item)
                if self._checked(item.request, transfer):
                    self._start_streaming(item, transfer, jobs)

    def _start_streaming(self, item, transfer: _Transfer, jobs: list[_StreamJob]) -> None:
        try:
            jobs.extend(self._stream_job(item, transfer))
        except WireError as exc:
            self._drop_transfer(item.request.request_id, exc)

    def _drop_transfer(self, request_id: str, exc: Exception) -> None:
        """Sending failed mid-step: stop sending this request's KV. The decode engine's bounded wait
        ends its side (recompute or error); this side frees after the KVWant timeout."""
        log.warning("streaming KV of %s failed: %s", request_id, exc)
        self._transfers.pop(request_id, None)

    def _stream_job(self, item, transfer: _Transfer) -> list[_StreamJob]:
        """The prompt tokens this step computes for one request (none if already sent)."""
        request = item.request
        start = request.num_computed_tokens
        if start > transfer.sent_upto:  # computed before the KVWant came: catch up from the cache
            self._send_range(request.request_id, transfer, item.block_ids, transfer.sent_upto, start)
        begin = max(start, transfer.sent_upto)  # a recompute after preemption is not sent twice
        end = min(start + item.num_new_tokens, request.num_prompt_tokens)
        if end <= begin:
            return []
        return [_StreamJob(request.request_id, transfer, begin, end, self._slots(item.block_ids, begin, end))]

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:  # [end - start] int64
        block_size = self.kv_cache.shape[3]
        positions = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.int64)
        slots = table[positions // block_size] * block_size + positions % block_size
        return slots.to(self.kv_cache.device)

    # ---- incoming ----

    def receive(self) -> None:
        for routed in self.server.drain():
            self._dispatch(routed.peer_id, routed.msg)

    def _dispatch(self, peer_id: bytes, msg) -> None:
        if isinstance(msg, Hello):
            self._on_hello(peer_id, msg)
        elif isinstance(msg, Abort):  # freeing is harmless, so any peer may ask for it
            self._on_abort(msg.request_id)
        elif peer_id not in self._peers:
            self.server.answer(peer_id, Error(code="no_hello", message="say Hello with your layout fingerprint first"))
        elif isinstance(msg, KVWant):
            self._on_want(peer_id, msg)
        elif isinstance(msg, KVAck):
            self._on_ack(msg)
        else:
            self.server.answer(peer_id, Error(code="unexpected", message=f"{msg.type_name} is not served on the KV link"))

    def _on_ack(self, msg: KVAck) -> None:
        awaiting = self._awaiting_ack.get(msg.request_id)
        if awaiting is not None and msg.ok:
            self.num_transfers += 1
            self.transfer_seconds += time.monotonic() - awaiting.computed_at
        self._release(msg.request_id, "acked" if msg.ok else f"nacked: {msg.reason}")

    def _on_hello(self, peer_id: bytes, msg: Hello) -> None:
        try:
            check_compatible(self.fingerprint, LayoutFingerprint.from_dict(msg.fingerprint))
        except (LayoutMismatchError, ProtocolError) as exc:
            log.error("refused KV link from %s: %s", msg.engine_id, exc)
            self.server.answer(peer_id, HelloAck(ok=False, reason=str(exc)[:4000]))
            return
        self._peers.add(peer_id)
        self.server.answer(peer_id, HelloAck(ok=True))

    def _on_want(self, peer_id: bytes, msg: KVWant) -> None:
        self._transfers[msg.request_id] = _Transfer(peer_id, msg.skip_tokens, msg.num_tokens, time.monotonic(),
                                                    sent_upto=msg.skip_tokens)
        self._try_finish(msg.request_id)

    def _on_abort(self, request_id: str) -> None:
        if not self.abort(request_id):
            self.aborted_by_peer.append(request_id)  # still computing: the service aborts it

    def abort(self, request_id: str) -> bool:
        """Forget a request; True if it was finished here (its blocks are released now)."""
        self._transfers.pop(request_id, None)
        if request_id in self._prefilled or request_id in self._awaiting_ack:
            self._release(request_id, "aborted")
            return True
        return False

    # ---- sending ----

    def _checked(self, request: Request, transfer: _Transfer) -> bool:
        """Validate a KVWant against the prompt once; a bad one is answered with Error and dropped."""
        if transfer.checked:
            return True
        block_size = self.kv_cache.shape[3]
        num_prompt = request.num_prompt_tokens
        if transfer.skip_tokens % block_size or transfer.skip_tokens + transfer.num_tokens != num_prompt:
            problem = (f"KVWant for tokens [{transfer.skip_tokens}, {transfer.skip_tokens + transfer.num_tokens}) "
                       f"does not fit the {num_prompt}-token prompt in blocks of {block_size}")
            self._transfers.pop(request.request_id, None)
            self.server.answer(transfer.peer_id, Error(code="bad_want", message=problem, request_id=request.request_id))
            self._release(request.request_id, problem)
            return False
        transfer.checked = True
        return True

    def _try_finish(self, request_id: str) -> None:
        """Once the prompt is computed and asked for: send what is left from the cache, then KVDone."""
        self._send_copied(wait=True)  # streamed layers go first, while the transfer is still current
        prefilled, transfer = self._prefilled.get(request_id), self._transfers.get(request_id)
        if prefilled is None or transfer is None or not self._checked(prefilled.request, transfer):
            return
        del self._prefilled[request_id], self._transfers[request_id]
        self._awaiting_ack[request_id] = _AwaitingAck(time.monotonic() + self.lease_s, prefilled.done_at)
        request = prefilled.request
        try:
            self._send_range(request_id, transfer, prefilled.block_ids, transfer.sent_upto, request.num_prompt_tokens)
            self.server.send(transfer.peer_id, KVDone(
                request_id=request_id, first_token=request.output_token_ids[0], num_tokens=transfer.num_tokens,
                checksum=combine_checksums(transfer.checksums),
                first_logprobs=request.logprobs[0] if request.logprobs else None))
        except WireError as exc:
            log.warning("sending KV of %s failed: %s", request_id, exc)
            self._release(request_id, str(exc))

    def _send_range(self, request_id: str, transfer: _Transfer, block_ids: list[int], start: int, end: int) -> None:
        """Every layer of prompt tokens [start, end) from the cache, grouped into ~4 MiB messages."""
        self._send_copied(wait=True)  # whatever was streamed for this request goes first
        if end <= start:
            return
        num_layers = self.kv_cache.shape[0]
        per_layer = self.kv_cache[0, :, 0, 0].numel() * (end - start) * self.kv_cache.element_size()
        step = max(1, min(num_layers, math.ceil(MESSAGE_TARGET_BYTES / per_layer)))
        block_size = self.kv_cache.shape[3]
        aligned = start % block_size == 0
        table = torch.tensor(block_ids[start // block_size:], dtype=torch.int64, device=self.kv_cache.device)
        slots = None if aligned else self._slots(block_ids, start, end)
        for layer_start in range(0, num_layers, step):
            layer_end = min(num_layers, layer_start + step)
            if aligned:  # whole blocks: [layers, 2, T, kv_heads, head_dim]
                with one_cpu_thread(self.kv_cache.device):
                    kv = kernels.kv_pack(self.kv_cache, table, end - start, layer_start, layer_end)
            else:
                kv = self._gather(layer_start, layer_end, slots)
            self._send_payload(request_id, transfer, kv.cpu(), layer_start, start)
        transfer.sent_upto = end

    def _gather(self, layer_start: int, layer_end: int, slots: torch.Tensor) -> torch.Tensor:
        """KV of layers [layer_start, layer_end) at cache slots [T], on the cache's device:
        [layers, 2, T, kv_heads, head_dim]."""
        with one_cpu_thread(self.kv_cache.device):
            return self.kv_cache[layer_start:layer_end].flatten(2, 3).index_select(2, slots)

    def _send_payload(self, request_id: str, transfer: _Transfer, kv: torch.Tensor, layer_start: int,
                      position: int) -> None:
        msg, payload = KVLayer.from_tensor(kv, request_id=request_id, layer_start=layer_start,
                                           token_start=position - transfer.skip_tokens)
        transfer.checksums.append(msg.checksum)
        self._send_layer(transfer.peer_id, msg, payload)

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
        for request_id, awaiting in list(self._awaiting_ack.items()):
            if now > awaiting.deadline:
                self._release(request_id, f"no KVAck within the {self.lease_s:g}s lease")
        for request_id, transfer in list(self._transfers.items()):
            if not transfer.checked and now - transfer.at > self.want_timeout_s:  # the prompt never came
                del self._transfers[request_id]
                self.server.answer(transfer.peer_id, Error(code="unknown_request", request_id=request_id,
                                                    message="this prefill engine never received that prompt"))

    def close(self) -> None:
        self.server.close()


def _parse_fault(spec: str) -> dict[int, str]:
    """"drop:3,corrupt:5" -> {3: "drop", 5: "corrupt"}; empty in production."""
    faults = {}
    for item in filter(None, spec.split(",")):
        action, _, index = item.partition(":")
        if action not in ("drop", "corrupt", "stall", "delay") or not index.isdigit():
            raise ValueError(f"{FAULT_ENV}={spec!r}: use comma-separated drop:N, corrupt:N, stall:N or delay:N")
        faults[int(index)] = action
    return faults
