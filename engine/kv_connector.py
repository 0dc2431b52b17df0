"""The scheduler-side hooks a KV connector implements (prefill and decode roles of disaggregation).

The scheduler calls these; a connector never touches the scheduler's queues itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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


class KVConnector:
    """Base class: a connector that moves nothing. Subclasses override what their role needs."""

    def num_external_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        """Tokens of the prompt, after the local prefix hit, whose KV will be loaded from outside."""
        return 0

    def on_blocks_allocated(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's blocks exist; a decode-role connector now asks the peer for the KV."""

    def on_request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """A request ended. True keeps its blocks allocated until `ConnectorEvents.sent` names it."""
        return False

    def on_request_aborted(self, request: Request) -> None:
        """A request was aborted at any stage; tell the peer so it frees its side too."""

    def poll(self) -> ConnectorEvents:
        return ConnectorEvents()

    def layer_hook(self, plan) -> Callable[[int], None] | None:
        """Called before a step runs; a callable returned is called with each layer index right after
        that layer's K/V of the step is in the cache (prefill role: stream KV while computing)."""
        return None

    # ---- network side, used by the service loop (not the scheduler) ----

    def sockets(self) -> list:
        """Sockets the service loop should wait on besides its control socket."""
        return []

    def receive(self) -> None:
        """Handle what arrived on the connector's sockets; called between steps."""

    def close(self) -> None:
        pass
