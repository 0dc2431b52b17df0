"""Prefill role, transfer side: the KV socket that serves decode engines' KVWant, and the sending.

The engine loop calls `receive()` between steps and `send_computed()` once a step's first tokens are
published; inside a step the model runner calls the hook that `layer_hook()` returns: layer streaming
(prefill/layer_stream.py) and, while a computed prompt waits on its decode engine, socket reads
(prefill/waiting_reads.py). Each request's transfer is one `Transfer`, shared
with the scheduler side (prefill/scheduler_side.py), which tells `finish()` when a prompt is computed.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from pdserve.engine.kv_connector import KVTransferSide
from pdserve.engine.request import Request
from pdserve.control.errors import ProtocolError, WireError
from pdserve.kvtransfer.errors import LayoutMismatchError
from pdserve.kvtransfer.fingerprint import LayoutFingerprint, check_compatible
from pdserve.control.messages import Abort, Error
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVWant
from pdserve.control.sockets import ServerSocket
from pdserve.prefill.host_copies import HostCopies, StreamedLayers
from pdserve.prefill.kv_sender import KVSender
from pdserve.prefill.layer_stream import StepStream
from pdserve.prefill.transfers import Transfer, TransferState
from pdserve.prefill.waiting_reads import WaitingTransferReads

log = logging.getLogger("pdserve.prefill.transfer_side")


class PrefillTransferSide(KVTransferSide):
    def __init__(self, server: ServerSocket, fingerprint: LayoutFingerprint, want_timeout_s: float = 30.0,
                 lease_s: float = 30.0, stream_layers: bool = True) -> None:
        super().__init__()
        self.server = server
        self.fingerprint = fingerprint
        self.want_timeout_s = want_timeout_s
        self.lease_s = lease_s
        self.stream_layers = stream_layers
        self.transfers: dict[str, Transfer] = {}  # shared with the scheduler side
        self.computed: list[Transfer] = []  # prompts computed in this step and asked for: KV to send next
        self.sender = KVSender(server, self.stats)
        self.copies = HostCopies(self._send_streamed)
        self._peers: set[bytes] = set()  # decode engines whose Hello was accepted

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.sender.bind_kv_cache(kv_cache)  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]

    def sockets(self) -> list:
        return [self.server.socket]

    def receive(self) -> None:
        self.send_computed()
        self.copies.send_landed(wait=True)  # between steps nothing streamed may linger
        self.read_messages()
        self._expire()

    def layer_hook(self, plan) -> Callable[[int], None] | None:
        """The step's per-layer hook: None (no call, no socket read) when it has nothing to stream and no
        computed prompt waits on its decode engine."""
        hooks = []
        if self.has_waiting_transfers():  # first: the stream starts a chunk whose KVWant it reads at the same layer
            hooks.append(WaitingTransferReads(self))
        if self.stream_layers:
            prompt_items = [item for item in plan.scheduled
                            if item.request.num_computed_tokens < item.request.num_prompt_tokens]
            stream = StepStream(self, prompt_items, self.sender.kv_cache.shape[0])
            if stream.has_work:
                hooks.append(stream)
        return _each_of(hooks)

    def has_waiting_transfers(self) -> bool:
        """Whether a computed prompt waits for its KVWant or its KVAck."""
        return any(transfer.waits_on_peer for transfer in self.transfers.values())

    def close(self) -> None:
        self.server.close()

    # ---- incoming ----

    def read_messages(self) -> None:
        """Handle every message waiting on the KV socket (also called mid-step by the layer hook)."""
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
        transfer = self.transfers.get(msg.request_id)
        if transfer is None:
            self.transfers[msg.request_id] = Transfer.wanted(msg.request_id, peer_id, msg.skip_tokens, msg.num_tokens)
        elif transfer.state is TransferState.WAITING_FOR_WANT:
            transfer.want(peer_id, msg.skip_tokens, msg.num_tokens)
            self.finish(transfer)
        else:
            log.warning("a second KVWant for %s (%s) ignored", msg.request_id, transfer.state.value)

    def _on_ack(self, msg: KVAck) -> None:
        transfer = self.transfers.get(msg.request_id)
        if transfer is None or transfer.is_ended:
            return
        if transfer.state is TransferState.AWAITING_ACK and msg.ok:
            self.stats.num_kv_transfers += 1
            self.stats.kv_transfer_seconds += time.monotonic() - transfer.computed_at
            transfer.move(TransferState.DONE, "acked")
        else:  # the decode engine gave up on it (a KVAck before KVDone is one, too)
            transfer.move(TransferState.FAILED, f"nacked: {msg.reason}" if not msg.ok else "acked before KVDone")

    def _on_abort(self, request_id: str) -> None:
        """The decode engine gave up: the scheduler side has the request aborted wherever it is (still
        computing here, or finished with its blocks held)."""
        transfer, reason = self.transfers.get(request_id), "aborted by the decode engine"
        if transfer is None:  # no KVWant came (the link was refused, say): the prompt may still be computing
            self.transfers[request_id] = Transfer(request_id, TransferState.ABORTED, reason=reason)
        elif transfer.state is not TransferState.DONE:
            transfer.move(TransferState.ABORTED, reason)

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, transfer in list(self.transfers.items()):
            waited = now - transfer.since
            if transfer.state is TransferState.WAITING_FOR_WANT and waited > self.want_timeout_s:
                transfer.move(TransferState.FAILED, f"no KVWant within {self.want_timeout_s:g}s")
            elif transfer.state is TransferState.AWAITING_ACK and waited > self.lease_s:
                transfer.move(TransferState.FAILED, f"no KVAck within the {self.lease_s:g}s lease")
            elif transfer.state is TransferState.WAITING_FOR_PROMPT and waited > self.want_timeout_s:
                del self.transfers[request_id]  # the prompt never came: no blocks to free
                self.server.answer(transfer.peer_id, Error(code="unknown_request", request_id=request_id,
                                                           message="this prefill engine never received that prompt"))
            elif transfer.state is TransferState.ABORTED and waited > self.want_timeout_s:
                del self.transfers[request_id]  # no step ran meanwhile, so there was nothing to abort

    # ---- sending ----

    def check_want(self, transfer: Transfer, request: Request) -> bool:
        """True once the KVWant fits the prompt (the transfer streams from then on). A bad one is
        answered with Error and fails the transfer; an ended transfer sends nothing more."""
        if transfer.state is TransferState.STREAMING:
            return True
        if transfer.is_ended:
            return False
        block_size = self.sender.kv_cache.shape[3]
        num_prompt = request.num_prompt_tokens
        if transfer.skip_tokens % block_size or transfer.skip_tokens + transfer.num_tokens != num_prompt:
            problem = (f"KVWant for tokens [{transfer.skip_tokens}, {transfer.skip_tokens + transfer.num_tokens}) "
                       f"does not fit the {num_prompt}-token prompt in blocks of {block_size}")
            transfer.move(TransferState.FAILED, problem)
            self.server.answer(transfer.peer_id, Error(code="bad_want", message=problem, request_id=request.request_id))
            return False
        transfer.move(TransferState.STREAMING)
        return True

    def send_computed(self) -> None:
        """Finish the transfers of the prompts the last step computed. The engine loop calls it right after
        it has published that step's first tokens, so a first token never waits for its KV to be sent."""
        computed, self.computed = self.computed, []
        for transfer in computed:
            self.finish(transfer)

    def finish(self, transfer: Transfer) -> None:
        """The prompt is computed and asked for: what was not streamed goes from the cache, then KVDone."""
        if not self.check_want(transfer, transfer.request):
            return
        end = transfer.request.num_prompt_tokens
        if not self.send_range(transfer, transfer.block_ids, transfer.sent_upto, end, during="sending"):
            return
        try:
            self.sender.send_done(transfer)
        except WireError as exc:
            self._fail(transfer, exc, "sending")
            return
        transfer.move(TransferState.AWAITING_ACK)

    def send_range(self, transfer: Transfer, block_ids: list[int], start: int, end: int,
                   during: str = "streaming") -> bool:
        """Every layer of prompt tokens [start, end) from the cache, after whatever was streamed before.
        False if the transfer has failed (or failed in sending what was streamed)."""
        self.copies.send_landed(wait=True)
        if transfer.state is not TransferState.STREAMING:
            return False
        try:
            self.sender.send_range(transfer, block_ids, start, end)
        except WireError as exc:
            self._fail(transfer, exc, during)
            return False
        return True

    def _send_streamed(self, streamed: StreamedLayers) -> None:
        transfer = streamed.transfer
        if transfer.state is not TransferState.STREAMING:  # failed or aborted meanwhile
            return
        try:
            self.sender.send_payload(transfer, streamed.kv, streamed.layer_start, streamed.position)
        except WireError as exc:  # never fail the step (other requests share it)
            self._fail(transfer, exc, "streaming")

    def _fail(self, transfer: Transfer, exc: Exception, during: str) -> None:
        """Sending failed: nothing more goes to this peer for the request. The decode engine's bounded
        wait ends its side (recompute or error); this side frees the blocks once the prompt is done."""
        log.warning("%s KV of %s failed: %s", during, transfer.request_id, exc)
        transfer.move(TransferState.FAILED, str(exc))


def _each_of(hooks: list[Callable[[int], None]]) -> Callable[[int], None] | None:
    """One per-layer hook that calls each of `hooks` in order (None for none)."""
    if len(hooks) <= 1:
        return hooks[0] if hooks else None

    def each(layer_idx: int) -> None:
        for hook in hooks:
            hook(layer_idx)

    return each
