"""A dual-role engine's KV connector: the prefill role's and the decode role's, side by side.

`DualSchedulerSide` hands each scheduler hook to the role it concerns: pulling a prompt's KV (external
tokens, the KVWant once blocks exist) to the decode side, keeping a finished prompt's blocks for a peer to
the prefill side, an abort to both. `DualTransferSide` drives both roles' sockets from the engine loop
and lends the prefill side's per-layer hook (the decode side has none). Each role keeps its own
transfers, keyed by request id, so a request is in at most one of them.

One pool holds both roles' blocks, which fixed roles never share: two dual engines can each fill theirs
with prompts they pull from the other while the prompts they compute for the other wait for blocks. The
transfer side breaks that wait as the prefill role breaks its own (docs/serving/dual-role.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from pdserve.decode.incoming import IncomingState
from pdserve.decode.scheduler_side import DecodeSchedulerSide
from pdserve.decode.transfer_side import DecodeTransferSide
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector, KVConnectorStats, KVTransferSide
from pdserve.engine.request import Request
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.transfer_side import PrefillTransferSide
from pdserve.prefill.transfers import TransferState

log = logging.getLogger("pdserve.dualrole.connector")


class DualSchedulerSide(KVConnector):
    def __init__(self, prefill: PrefillSchedulerSide, decode: DecodeSchedulerSide) -> None:
        self.prefill = prefill
        self.decode = decode

    def num_external_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        """Only a request naming a trusted peer's KV address (the decode role) loads tokens from outside."""
        return self.decode.num_external_tokens(request, num_local_hit_tokens)

    def on_blocks_allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.decode.on_blocks_allocated(request, block_ids, num_external_tokens)

    def on_request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """The prefill role keeps a computed prompt's blocks for its peer; any other request frees them."""
        return self.prefill.on_request_finished(request, block_ids)

    def on_request_aborted(self, request: Request) -> None:
        self.prefill.on_request_aborted(request)
        self.decode.on_request_aborted(request)

    def poll(self) -> ConnectorEvents:
        """Both roles' news: blocks sent or given up by peers (prefill), KV received or failed (decode)."""
        sent, received = self.prefill.poll(), self.decode.poll()
        return ConnectorEvents(received=received.received, failed=received.failed, sent=sent.sent,
                               aborted=sent.aborted)


class DualTransferSide(KVTransferSide):
    """Both roles' transfer sides; the servers' own calls (PrefillServer's, DecodeServer's) reach the role
    they belong to."""

    def __init__(self, prefill: PrefillTransferSide, decode: DecodeTransferSide, release_pulls: bool = True) -> None:
        self.prefill = prefill  # the KV socket peers pull this engine's prompts from
        self.decode = decode  # the links to the peers this engine pulls prompts from
        self.release_pulls = release_pulls  # a pull given up recomputes (--kv-failure recompute), never fails

    @property
    def stats(self) -> KVConnectorStats:
        """Each figure summed over both roles (EngineStats has one of each)."""
        mine, theirs = dataclasses.asdict(self.prefill.stats), dataclasses.asdict(self.decode.stats)
        return KVConnectorStats(**{name: mine[name] + theirs[name] for name in mine})

    def bind_kv_groups(self, kv_groups) -> None:
        self.prefill.bind_kv_groups(kv_groups)
        self.decode.bind_kv_groups(kv_groups)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.prefill.bind_kv_cache(kv_cache)
        self.decode.bind_kv_cache(kv_cache)

    def sockets(self) -> list:
        return [*self.prefill.sockets(), *self.decode.sockets()]

    def receive(self) -> None:
        """The prefill role first (what it sends frees blocks), then the decode role, even if the first raised."""
        try:
            self.prefill.receive()
        finally:
            self.decode.receive()
        self._release_pull_for_wanted_prompt()

    def _release_pull_for_wanted_prompt(self) -> None:
        """A peer has blocks reserved for a prompt queued here that waits for free blocks, while blocks here
        wait for prompts no peer has computed yet (that peer may be as full, in a cycle): the newest such pull
        is given up, its peer told to drop the prompt, and the request recomputes here. One at a time: none
        while an ended pull's blocks are still to be freed."""
        pulls = self.decode.transfers.values()
        if not self.release_pulls or any(t.state is not IncomingState.RECEIVING for t in pulls):
            return
        if not any(t.state is TransferState.WAITING_FOR_PROMPT and self.prefill.waits_for_blocks(t.request_id)
                   for t in self.prefill.transfers.values()):
            return
        idle = [t for t in pulls if t.computed_at is None and not any(t.layer_tokens_received)]
        if idle:
            newest = max(idle, key=lambda t: t.started)
            reason = "released for a prompt a peer waits on here: recomputed locally"
            log.info("gave up pulling the KV of %s: %s", newest.request_id, reason)
            self.decode.abort(newest, "released on decode")
            self.decode.stats.num_kv_transfers_failed += 1
            newest.fail(reason)

    def layer_hook(self, plan) -> Callable[[int], None] | None:
        return self.prefill.layer_hook(plan)

    def close(self) -> None:
        try:
            self.prefill.close()
        finally:
            self.decode.close()

    # ---- the prefill role's calls (PrefillServer) ----

    @property
    def server(self):  # the KV socket: its address is the engine's kv_address
        return self.prefill.server

    @property
    def first_token_ends(self) -> Callable[[str], bool]:
        return self.prefill.first_token_ends

    @first_token_ends.setter
    def first_token_ends(self, answer: Callable[[str], bool]) -> None:
        self.prefill.first_token_ends = answer

    def send_computed(self) -> None:
        self.prefill.send_computed()

    # ---- the decode role's calls (DecodeServer) ----

    def hold(self, request_id: str, address: str) -> None:
        self.decode.hold(request_id, address)

    def prompt_computed(self, request_id: str) -> None:
        self.decode.prompt_computed(request_id)
