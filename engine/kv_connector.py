"""The two sides of a KV connector (prefill and decode roles of disaggregation).

`KVConnector` is the scheduler side: hooks the scheduler calls, bookkeeping only, no sockets.
`KVTransferSide` owns the sockets and the copies; the engine loop drives it between steps, and the
model runner calls its one per-layer hook inside a step. The base classes move nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.kv_cache_groups import BlockIds, KVCacheGroups
from pdserve.engine.request import Request


@dataclass
class ConnectorEvents:
    """What the connector learned since the last step."""

    # Decode role: requests whose external KV has fully landed, with the first token sampled remotely
    # and its logprobs (None unless the request asked for them).
    received: dict[str, tuple[int, dict[int, float] | None]] = field(default_factory=dict)
    # Decode role: requests whose external KV will never come (peer died, bad checksum, timeout).
    failed: dict[str, str] = field(default_factory=dict)
    # Prefill role: requests whose blocks the peer has acknowledged (or whose lease expired): free them now.
    sent: set[str] = field(default_factory=set)
    # Prefill role: requests the peer gave up on: abort them wherever they are (computing or held).
    aborted: set[str] = field(default_factory=set)


@dataclass
class KVConnectorStats:
    """An engine's KV transfers since start, one counter per fact (named as in EngineStats)."""

    kv_bytes_sent: int = 0  # KVLayer payload bytes (prefill role)
    kv_bytes_received: int = 0  # KVLayer payload bytes written into blocks (decode role)
    num_kv_transfers: int = 0  # completed: acked by the peer (prefill) or verified (decode)
    num_kv_transfers_failed: int = 0  # transfers that ended without the KV in place (decode role)
    # Summed time of the completed transfers. Prefill: prompt computed -> KVAck, the part that layer
    # streaming did not hide behind compute. Decode: KVWant sent -> KVDone verified.
    kv_transfer_seconds: float = 0.0


class KVConnector:
    """Scheduler side. Subclasses override what their role needs; a connector never touches the
    scheduler's queues itself."""

    def num_external_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        """Tokens of the prompt, after the local prefix hit, whose KV will be loaded from outside."""
        return 0

    def on_blocks_allocated(self, request: Request, block_ids: BlockIds, num_external_tokens: int) -> None:
        """The request's blocks exist (one table, or one per layer group); a decode-role connector now asks
        the peer for the KV."""

    def on_request_finished(self, request: Request, block_ids: BlockIds) -> bool:
        """A request ended. True keeps its blocks allocated until `ConnectorEvents.sent` names it."""
        return False

    def on_request_aborted(self, request: Request) -> None:
        """A request was aborted at any stage (its blocks may be held for the peer); stop its transfer."""

    def poll(self) -> ConnectorEvents:
        return ConnectorEvents()


class KVTransferSide:
    """Transfer side: sockets and copies, driven by the engine loop and the per-layer hook."""

    def __init__(self) -> None:
        self.stats = KVConnectorStats()
        self.kv_groups: KVCacheGroups | None = None  # the engine's layer groups (None: one block table)

    def bind_kv_groups(self, kv_groups: KVCacheGroups | None) -> None:
        """The layer groups of the engine's KV cache (ModelRunner.kv_groups), told by EngineCore when it is
        built, before the cache is bound: each layer's KV is then read and written through its group's blocks."""
        self.kv_groups = kv_groups

    def sockets(self) -> list:
        """Sockets the engine loop should wait on besides its control socket."""
        return []

    def receive(self) -> None:
        """The engine loop's call between steps: handle what arrived, end what timed out."""

    def layer_hook(self, plan) -> Callable[[int], None] | None:
        """Called before a step runs; a callable returned is called with each layer index right after
        that layer's K/V of the step is in the cache (prefill role: stream KV while computing)."""
        return None

    def close(self) -> None:
        pass
