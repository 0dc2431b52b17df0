"""Prefill role, transfer side: the KV socket that serves decode engines' KVWant, and the sending.

The engine loop calls `receive()` between steps and `send_computed()` once a step's first tokens are
published; inside a step the model runner calls the hook that `layer_hook()` returns: layer streaming
(prefill/layer_stream.py) and, while a computed prompt waits on its decode engine, socket reads
(prefill/waiting_reads.py). Each request's transfer is one `Transfer`, shared
with the scheduler side (prefill/scheduler_side.py), which tells `finish()` when a prompt is computed.
Every answer carries this process's incarnation; a decode engine's Hello with a new incarnation of the same
engine id means it restarted, and what this side held for the old one goes at once.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

import torch

from pdserve.engine.kv_cache_groups import BlockIds, CacheLayers
from pdserve.engine.kv_connector import KVTransferSide
from pdserve.engine.request import Request
from pdserve.control.errors import ProtocolError, WireError
from pdserve.kvtransfer.errors import LayoutMismatchError
from pdserve.kvtransfer.fingerprint import LayoutFingerprint, check_compatible, for_cache
from pdserve.control.messages import Abort, Error
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVHold, KVWant
from pdserve.control.sockets import ServerSocket
from pdserve.prefill.host_copies import HostCopies, StreamedLayers
from pdserve.prefill.kv_sender import KVSender
from pdserve.prefill.layer_stream import StepStream
from pdserve.prefill.transfers import Transfer, TransferState
from pdserve.prefill.waiting_reads import WaitingTransferReads

log = logging.getLogger("pdserve.prefill.transfer_side")

MAX_REMEMBERED = 4096  # ended transfers (and holds for prompts not computed yet) remembered, newest kept


class PrefillTransferSide(KVTransferSide):
    def __init__(self, server: ServerSocket, fingerprint: LayoutFingerprint, want_timeout_s: float = 30.0,
                 lease_s: float = 30.0, stream_layers: bool = True, hold_timeout_s: float = 600.0,
                 incarnation: str = "") -> None:
        super().__init__()
        self.server = server
        self.incarnation = incarnation  # this process's (control.messages.new_incarnation)
        self.fingerprint = fingerprint
        # A computed prompt's blocks wait want_timeout_s for its KVWant, or hold_timeout_s once a decode engine
        # has said it has the request queued (KVHold): a decode engine whose KV pool is full asks late.
        for flag, seconds in (("--kv-want-timeout", want_timeout_s), ("--kv-hold-timeout", hold_timeout_s),
                              ("--kv-lease", lease_s)):
            if not seconds > 0:
                raise ValueError(f"{flag} {seconds:g} must be > 0 seconds")
        self.layout = fingerprint.link_layout()  # which tokens of which layers travel
        self.want_timeout_s = want_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self.lease_s = lease_s
        self.stream_layers = stream_layers
        self.transfers: dict[str, Transfer] = {}  # shared with the scheduler side
        self.holds_prompt: Callable[[str], bool] = lambda request_id: False  # queued or computing here
        self.waits_for_blocks: Callable[[str], bool] = lambda request_id: False  # queued, no free KV blocks
        # whether a request's first token ends it (no decode engine will ask): PrefillServer answers, from its
        # set of the requests that go on; unbound, every request goes on
        self.first_token_ends: Callable[[str], bool] = lambda request_id: False
        # KVHold before the prompt was computed: request id -> (when, the decode engine's peer id)
        self._holds: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> why its transfer ended
        self.computed: list[Transfer] = []  # prompts computed in this step and asked for: KV to send next
        self.sender = KVSender(server, self.stats)
        self.copies = HostCopies(self._send_streamed)
        self._peers: dict[bytes, tuple[str, str]] = {}  # accepted Hello: peer id -> (engine id, incarnation)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """The cache [num_layers, planes, num_blocks, block_size, *per_token] whose KV goes out, or with layer
        groups (bind_kv_groups) [layers_per_group, ...] read through each group's blocks; the
        fingerprint takes its planes and per-token shape from it."""
        layers = CacheLayers.of_cache(kv_cache.shape[0], self.kv_groups)
        self.fingerprint = for_cache(self.fingerprint, (layers.num_layers, *kv_cache.shape[1:]))
        self.layout = self.fingerprint.link_layout()
        self.sender.bind_kv_cache(kv_cache, layers)

    def bind_scheduler(self, holds_prompt: Callable[[str], bool], waits_for_blocks: Callable[[str], bool]) -> None:
        """What the engine's scheduler knows of a prompt: queued or computing here; queued behind the last
        step's want of free KV blocks."""
        self.holds_prompt, self.waits_for_blocks = holds_prompt, waits_for_blocks

    def take_hold(self, request_id: str) -> bytes:
        """The decode engine (peer id) that said it has this request queued (KVHold) before its prompt was
        computed; b"" when none did."""
        hold = self._holds.pop(request_id, None)
        return hold[1] if hold is not None else b""

    def forget(self, transfer: Transfer) -> None:
        """An ended transfer leaves: a KVWant that comes for it later is answered at once with why. A failed one
        counts (timed out, released, nacked, a send failed), as the decode engine counts its own."""
        _remember(self._ended, transfer.request_id, transfer.reason or transfer.state.value)
        if transfer.state is TransferState.FAILED:
            self.stats.num_kv_transfers_failed += 1

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
            stream = StepStream(self, prompt_items, self.sender.layers.num_layers)
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
        elif peer_id not in self._peers:  # a link opened to this process's predecessor at the same address, say
            self._answer_error(peer_id, "no_hello", "say Hello with your layout fingerprint first: this prefill "
                               f"engine (incarnation {self.incarnation}) has not accepted a Hello on this link",
                               getattr(msg, "request_id", None))
        elif isinstance(msg, KVWant):
            self._on_want(peer_id, msg)
        elif isinstance(msg, KVHold):
            self._on_hold(peer_id, msg.request_id)
        elif isinstance(msg, KVAck):
            self._on_ack(msg)
        else:
            self._answer_error(peer_id, "unexpected", f"{msg.type_name} is not served on the KV link")

    def _answer_error(self, peer_id: bytes, code: str, message: str, request_id: str | None = None) -> None:
        self.server.answer(peer_id, Error(code=code, message=message[:4000], request_id=request_id,
                                          incarnation=self.incarnation))

    def _on_hello(self, peer_id: bytes, msg: Hello) -> None:
        try:
            check_compatible(self.fingerprint, LayoutFingerprint.from_dict(msg.fingerprint))
        except (LayoutMismatchError, ProtocolError) as exc:
            log.error("refused KV link from %s: %s", msg.engine_id, exc)
            self.server.answer(peer_id, HelloAck(ok=False, reason=str(exc)[:4000], incarnation=self.incarnation))
            return
        self._forget_predecessors(msg.engine_id, msg.incarnation)
        self._peers[peer_id] = (msg.engine_id, msg.incarnation)
        self.server.answer(peer_id, HelloAck(ok=True, incarnation=self.incarnation))

    def _forget_predecessors(self, engine_id: str, incarnation: str) -> None:
        """A decode engine said Hello with a new incarnation: it restarted, and its predecessor's requests are
        gone with it. What this side held for them goes now instead of at a timeout: computed prompts held
        for it or sent to it (their blocks are freed), prompts it asked for that are still to compute
        (aborted), its KVHolds for prompts not computed yet."""
        old = {peer for peer, (known_id, known) in self._peers.items()
               if known_id == engine_id and known and incarnation and known != incarnation}
        if not old:
            return
        reason = f"decode engine {engine_id} restarted (incarnation {incarnation}): its requests are gone"
        log.warning("%s: freeing what was held for its predecessor", reason)
        for peer in old:
            del self._peers[peer]
        for transfer in self.transfers.values():
            if transfer.is_ended or (transfer.peer_id not in old and transfer.held_by not in old):
                continue
            computed = transfer.request is not None
            transfer.move(TransferState.FAILED if computed else TransferState.ABORTED, reason)
        for request_id in [rid for rid, (_, peer) in self._holds.items() if peer in old]:
            del self._holds[request_id]

    def _on_want(self, peer_id: bytes, msg: KVWant) -> None:
        transfer = self.transfers.get(msg.request_id)
        if transfer is None and msg.request_id in self._ended:
            self._answer_error(peer_id, "kv_released", "this prefill engine no longer holds that prompt's KV: "
                               f"{self._ended[msg.request_id]}", msg.request_id)
        elif transfer is None:
            self.transfers[msg.request_id] = Transfer.wanted(msg.request_id, peer_id, msg.skip_tokens, msg.num_tokens)
        elif transfer.state is TransferState.WAITING_FOR_WANT:
            transfer.want(peer_id, msg.skip_tokens, msg.num_tokens)
            self.finish(transfer)
        else:
            log.warning("a second KVWant for %s (%s) ignored", msg.request_id, transfer.state.value)

    def _on_hold(self, peer_id: bytes, request_id: str) -> None:
        transfer = self.transfers.get(request_id)
        if transfer is None:
            _remember(self._holds, request_id, (time.monotonic(), peer_id))
        elif transfer.state is TransferState.WAITING_FOR_WANT:
            transfer.held_by = peer_id

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
            if transfer.state is TransferState.WAITING_FOR_WANT:
                limit, flag = ((self.hold_timeout_s, "--kv-hold-timeout") if transfer.held_by_peer
                               else (self.want_timeout_s, "--kv-want-timeout"))
                if waited > limit:
                    transfer.move(TransferState.FAILED, f"no KVWant within {limit:g}s ({flag})")
            elif transfer.state is TransferState.AWAITING_ACK and waited > self.lease_s:
                transfer.move(TransferState.FAILED, f"no KVAck within the {self.lease_s:g}s lease")
            elif (transfer.state is TransferState.WAITING_FOR_PROMPT and waited > self.want_timeout_s
                  and not self.holds_prompt(request_id)):  # a prompt queued or computing here is on its way
                del self.transfers[request_id]  # the prompt never came: no blocks to free
                self._answer_error(transfer.peer_id, "unknown_request",
                                   "this prefill engine never received that prompt", request_id)
            elif transfer.state is TransferState.ABORTED and waited > self.want_timeout_s:
                del self.transfers[request_id]  # no step ran meanwhile, so there was nothing to abort
        while self._holds and now - next(iter(self._holds.values()))[0] > self.hold_timeout_s:
            self._holds.popitem(last=False)  # the prompt never came or was aborted before it was computed
        self._release_for_wanted_prompt()

    def _release_for_wanted_prompt(self) -> None:
        """Break a wait that no timeout would end soon. A decode engine has blocks reserved for a prompt queued
        here that waits for free KV blocks, while blocks here hold computed prompts that no decode engine has
        asked for yet (those engines may be full of prompts waiting on other prefill engines, in a cycle).
        The longest-held of them goes: its decode engine's KVWant is answered kv_released, and it recomputes.
        One at a time: none while the blocks of an ended transfer are still to be freed."""
        transfers = self.transfers.values()
        if any(t.is_ended and t.request is not None for t in transfers):
            return
        held = [t for t in transfers if t.state is TransferState.WAITING_FOR_WANT]
        if held and any(t.state is TransferState.WAITING_FOR_PROMPT and self.waits_for_blocks(t.request_id)
                        for t in transfers):
            oldest = min(held, key=lambda t: t.since)
            log.info("released the KV of %s (not asked for yet) for a prompt that a decode engine waits on",
                     oldest.request_id)
            oldest.move(TransferState.FAILED, "released for a prompt that a decode engine was waiting on")

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
            self._answer_error(transfer.peer_id, "bad_want", problem, request.request_id)
            return False
        transfer.first_positions = self.layout.first_positions(num_prompt, transfer.skip_tokens)
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

    def send_range(self, transfer: Transfer, block_ids: BlockIds, start: int, end: int,
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


def _remember(memory: OrderedDict, key: str, value) -> None:
    """Keep key -> value as the newest of at most MAX_REMEMBERED entries."""
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > MAX_REMEMBERED:
        memory.popitem(last=False)
