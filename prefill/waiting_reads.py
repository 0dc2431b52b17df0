"""The per-layer hook that keeps the prefill engine listening during a step while a computed prompt's
transfer waits on its decode engine (for the KVWant, or for the KVAck).

At a layer boundary, at most every READ_INTERVAL_S, it reads the KV socket
(`PrefillTransferSide.read_messages`): a KVWant for a computed prompt sends that prompt's KV from the
cache and KVDone there and then, and a KVAck is taken when it comes, so the exposed-transfer timer
stops at the ack rather than at the end of the step. Once no transfer waits any more, it reads no more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.prefill.transfer_side import PrefillTransferSide

# A drain of an empty socket costs microseconds and a CPU layer of a prefill step milliseconds; the
# bound keeps many short layers (small steps, or a GPU launching layers ahead) from reading each time.
READ_INTERVAL_S = 0.002


class WaitingTransferReads:
    def __init__(self, side: PrefillTransferSide, clock: Callable[[], float] = time.monotonic) -> None:
        self.side = side
        self.clock = clock
        self.last_read = float("-inf")
        self.active = True  # False once no transfer waits: the rest of the step reads nothing

    def __call__(self, layer_idx: int) -> None:
        if not self.active:
            return
        now = self.clock()
        if now - self.last_read < READ_INTERVAL_S:
            return
        self.last_read = now
        # Safe mid-step: what a KVWant sends here is the KV of a prompt that an earlier step finished.
        # Its blocks stay allocated to it (delayed free) until the ack, so this step, which writes only
        # into the blocks of the requests it schedules, never writes them.
        self.side.read_messages()
        self.active = self.side.has_waiting_transfers()
