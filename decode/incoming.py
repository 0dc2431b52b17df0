"""One prompt's KV transfer on the decode engine: one object, one explicit state, shared by the
connector's scheduler side and its transfer side (the state diagram is in docs/design/kv-link.md)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.request import Request


class IncomingState(enum.Enum):
    RECEIVING = "receiving"  # KVWant sent; KVLayer frames are written into the blocks as they come
    RECEIVED = "received"  # KVDone verified and acked: the request decodes from the next step on
    FAILED = "failed"  # unreachable, refused, incomplete, corrupt, a peer error or timed out


@dataclass
class IncomingTransfer:
    """Prompt tokens [skip_tokens, skip_tokens + num_tokens) of `request`, from the prefill engine at
    `address` into the request's blocks."""

    request: Request
    block_ids: tuple[torch.Tensor, ...]  # per block table (one, or one per layer group): [num_blocks] int64
    skip_tokens: int
    num_tokens: int
    address: str
    state: IncomingState = IncomingState.RECEIVING
    started: float = field(default_factory=time.monotonic)  # when the KVWant went out
    computed_at: float | None = None  # when the prefill engine was known to have computed the prompt
    link_serial: int = 0  # the link (decode/transfer_side.py) its KVWant went on
    resent: bool = False  # its KVWant went again on a new link, once (the old one reached a restarted engine)
    # [num_layers]: each layer's first prompt position that travels (kvtransfer.layout), set when it is asked
    first_positions: tuple[int, ...] = ()
    layer_tokens_received: list[int] = field(default_factory=list)  # [num_layers]: tokens written per layer
    checksums: list[int] = field(default_factory=list)  # of the KVLayer messages, in arrival order
    first_token: int | None = None  # RECEIVED: sampled on the prefill engine, with its logprobs if asked
    first_logprobs: dict[int, float] | None = None
    reason: str = ""  # FAILED: why

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def received(self, first_token: int, first_logprobs: dict[int, float] | None) -> None:
        self.state, self.first_token, self.first_logprobs = IncomingState.RECEIVED, first_token, first_logprobs

    def fail(self, reason: str) -> None:
        self.state, self.reason = IncomingState.FAILED, reason
