"""The per-layer hook of one prefill step: the step's new prompt KV goes to the decode engines that
asked for it, each layer as soon as it is stored.

At each layer boundary, in this order:
1. if a prompt chunk of the step has no KVWant yet, read the KV socket once
   (`PrefillTransferSide.read_messages`): a KVWant that arrived mid-step starts streaming here, and
   the layers stored before it go in one catch-up message;
2. queue this layer of every streamed chunk for the host (`HostCopies.copy`): the chunk's tokens that
   the layer carries (a sliding-window layer only those in its window at the handoff, kvtransfer.layout);
3. send the queued layers whose copy has landed, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.scheduler import ScheduledRequest
from pdserve.kvtransfer.layout import LinkLayout
from pdserve.prefill.transfers import Transfer, TransferState

if TYPE_CHECKING:
    from pdserve.prefill.transfer_side import PrefillTransferSide


@dataclass
class StreamJob:
    """Prompt tokens [begin, end) that this step computes, streamed to the transfer's peer per layer."""

    transfer: Transfer
    begin: int
    end: int
    slots: tuple[torch.Tensor, ...]  # per block table: [end - begin] int64 cache slots
    next_layer: int = 0  # layers below this one are queued for sending


class StepStream:
    def __init__(self, side: PrefillTransferSide, prompt_items: list[ScheduledRequest], num_layers: int) -> None:
        self.side = side
        self.last_layer = num_layers - 1
        self.jobs: list[StreamJob] = []
        self.unasked: list[ScheduledRequest] = []  # prompt chunks of this step whose KVWant has not come yet
        for item in prompt_items:
            transfer = side.transfers.get(item.request.request_id)
            if transfer is None:
                self.unasked.append(item)
            else:
                self._start(item, transfer)

    @property
    def has_work(self) -> bool:
        return bool(self.jobs or self.unasked)

    def __call__(self, layer_idx: int) -> None:
        if self.unasked:
            self._pick_up_wants()
        for job in self.jobs:
            if job.transfer.state is not TransferState.STREAMING:  # failed or aborted meanwhile
                continue
            firsts = job.transfer.first_positions
            for span in LinkLayout.spans(firsts, job.next_layer, layer_idx + 1, job.begin, job.end):
                slots = tuple(table_slots[span.start - job.begin:] for table_slots in job.slots)
                kv = self.side.sender.gather(span.layer_start, span.layer_end, slots)  # [layers, planes, T, ...]
                self.side.copies.copy(job.transfer, kv, span.layer_start, span.start)
            job.next_layer = layer_idx + 1
            if layer_idx == self.last_layer:  # queued in order: sent before anything else of this transfer
                job.transfer.sent_upto = job.end
        self.side.copies.send_landed(wait=False)

    def _pick_up_wants(self) -> None:
        """Step 1: read the KV socket; start streaming the chunks whose KVWant has just come."""
        self.side.read_messages()
        for item in list(self.unasked):
            transfer = self.side.transfers.get(item.request.request_id)
            if transfer is not None:
                self.unasked.remove(item)
                self._start(item, transfer)

    def _start(self, item: ScheduledRequest, transfer: Transfer) -> None:
        """Stream this chunk's tokens if the KVWant fits the prompt; first catch up, from the cache, on
        tokens computed before the KVWant came. A recompute after preemption is not sent twice."""
        request = item.request
        if not self.side.check_want(transfer, request):
            return
        start = request.num_computed_tokens
        caught_up = start <= transfer.sent_upto or self.side.send_range(
            transfer, item.block_ids, transfer.sent_upto, start)
        if not caught_up:
            return
        begin = max(start, transfer.sent_upto)
        end = min(start + item.num_new_tokens, request.num_prompt_tokens)
        if end > max(begin, min(transfer.first_positions)):  # some layer carries some of these tokens
            self.jobs.append(StreamJob(transfer, begin, end, self.side.sender.slots(item.block_ids, begin, end)))
