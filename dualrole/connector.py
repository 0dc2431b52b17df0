"""A dual-role engine's KV connector: the prefill role's and the decode role's, side by side.

`DualSchedulerSide` hands each scheduler hook to the role it concerns: pulling a prompt's KV (external
tokens, the KVWant once blocks exist) to the decode side, keeping a finished prompt's blocks for a peer to
the prefill side, an abort to both. `DualTransferSide` drives both roles' sockets from the engine loop
and lends the prefill side's per-layer hook (the decode side has none). Each role keeps its own
transfers, keyed by request id, so a request is in at most one of them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from pdserve.decode.scheduler_side import DecodeSchedulerSide
from pdserve.decode.transfer_side import DecodeTransferSide
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector, KVConnectorStats, KVTransferSide
from pdserve.engine.request import Request
from pdserve.prefill.scheduler_side import PrefillSchedulerSide
from pdserve.prefill.transfer_side import PrefillTransferSide


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

    def __init__(self, prefill: PrefillTransferSide, decode: DecodeTransferSide) -> None:  # noqa: D107
        self.prefill = prefill  # the KV socket peers pull this engine's prompts from
        self.decode = decode  # the links to the peers this engine pulls prompts from

    @property
    def stats(self) -> KVConnectorStats:
        """Each figure summed over both roles (EngineStats has one of each)."""
        mine, theirs = dataclasses.asdict(self.prefill.stats), dataclasses.asdict(self.decode.stats)
        return KVConnectorStats(**{name: mine[name] + theirs[name] for name in mine})

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
