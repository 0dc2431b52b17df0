"""One prompt's KV transfer on the prefill engine: one object, one explicit state, shared by the
connector's scheduler side and its transfer side (the state diagram is in docs/design/kv-link.md)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_groups import BlockIds
from pdserve.engine.request import Request


class TransferState(enum.Enum):
    WAITING_FOR_WANT = "waiting_for_want"  # the prompt was computed first: blocks held, no KVWant yet
    WAITING_FOR_PROMPT = "waiting_for_prompt"  # the KVWant came first; not yet checked against the prompt
    STREAMING = "streaming"  # the KVWant fits the prompt; its KV goes out as the steps store it
    AWAITING_ACK = "awaiting_ack"  # all KV and KVDone sent; blocks held until KVAck or the lease ends
    DONE = "done"  # acked: the blocks may go
    FAILED = "failed"  # nacked, timed out, a send failed or the KVWant did not fit: nothing more goes out
    ABORTED = "aborted"  # aborted by the router or the decode engine: nothing more goes out


ENDED = frozenset({TransferState.DONE, TransferState.FAILED, TransferState.ABORTED})
# The prompt is computed and its blocks held; what comes next is up to the decode engine.
WAITING_ON_PEER = frozenset({TransferState.WAITING_FOR_WANT, TransferState.AWAITING_ACK})


@dataclass
class Transfer:
    """Prompt tokens [skip_tokens, skip_tokens + num_tokens) of one request, going to peer_id. The
    KVWant fields are set by the transfer side when it arrives, the prompt fields by the scheduler side
    when the prompt is computed (its blocks stay allocated until the transfer has ended)."""

    request_id: str
    state: TransferState
    since: float = field(default_factory=time.monotonic)  # entered its state; bounds count from here
    reason: str = ""  # why it ended
    # from the KVWant
    peer_id: bytes = b""
    skip_tokens: int = 0
    num_tokens: int = 0
    sent_upto: int = 0  # every layer's tokens before this position that it carries have been sent
    # [num_layers]: each layer's first prompt position that travels (kvtransfer.layout), set once the KVWant fits
    first_positions: tuple[int, ...] = ()
    checksums: list[int] = field(default_factory=list)  # of the KVLayer messages, in send order
    held_by: bytes = b""  # the decode engine (peer id) that has it queued (KVHold): kept up to the hold timeout
    # from the scheduler, once the prompt is computed
    request: Request | None = None
    block_ids: BlockIds = field(default_factory=list)  # get_block_ids: one table, or one per layer group
    computed_at: float = 0.0  # when the prompt's last layer was computed

    @classmethod
    def wanted(cls, request_id: str, peer_id: bytes, skip_tokens: int, num_tokens: int) -> Transfer:
        transfer = cls(request_id, TransferState.WAITING_FOR_PROMPT)
        transfer.want(peer_id, skip_tokens, num_tokens)
        return transfer

    @classmethod
    def computed(cls, request: Request, block_ids: BlockIds) -> Transfer:
        transfer = cls(request.request_id, TransferState.WAITING_FOR_WANT)
        transfer.prompt_computed(request, block_ids)
        return transfer

    @property
    def is_ended(self) -> bool:
        return self.state in ENDED

    @property
    def held_by_peer(self) -> bool:
        return bool(self.held_by)

    @property
    def waits_on_peer(self) -> bool:
        return self.state in WAITING_ON_PEER

    def want(self, peer_id: bytes, skip_tokens: int, num_tokens: int) -> None:
        self.peer_id, self.skip_tokens, self.num_tokens = peer_id, skip_tokens, num_tokens
        self.sent_upto = skip_tokens

    def prompt_computed(self, request: Request, block_ids: BlockIds) -> None:
        self.request, self.block_ids, self.computed_at = request, block_ids, time.monotonic()

    def move(self, state: TransferState, reason: str = "") -> None:
        self.state, self.since, self.reason = state, time.monotonic(), reason
