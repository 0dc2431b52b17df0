"""Decode role, scheduler side: which prompt tokens come from a prefill engine, one transfer per
request once its blocks are allocated, and the scheduler told when the KV has landed or never will.
No sockets: asking and aborting go through the transfer side (decode/transfer_side.py)."""

from __future__ import annotations

import torch

from pdserve.decode.incoming import IncomingState, IncomingTransfer
from pdserve.decode.transfer_side import DecodeTransferSide
from pdserve.engine.kv_cache_groups import BlockIds
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector
from pdserve.engine.request import Request


class DecodeSchedulerSide(KVConnector):
    def __init__(self, transfer_side: DecodeTransferSide) -> None:
        self.transfer_side = transfer_side
        self.transfers = transfer_side.transfers

    def num_external_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        if request.prefill_kv_address is None:
            return 0
        return request.num_prompt_tokens - num_local_hit_tokens

    def on_blocks_allocated(self, request: Request, block_ids: BlockIds, num_external_tokens: int) -> None:
        """block_ids: one table, or one per layer group (a sliding group's blocks before its window are
        never allocated: nothing is sent for them)."""
        skip = request.num_computed_tokens  # the local prefix hit, block aligned
        tables = tuple(torch.tensor(ids, dtype=torch.int64) for ids in self.transfer_side.tables(block_ids))
        incoming = IncomingTransfer(request, tables, skip, num_external_tokens, request.prefill_kv_address)
        self.transfers[request.request_id] = incoming
        self.transfer_side.ask(incoming)

    def on_request_aborted(self, request: Request) -> None:
        incoming = self.transfers.pop(request.request_id, None)
        if incoming is not None and incoming.state is IncomingState.RECEIVING:
            self.transfer_side.abort(incoming, "aborted on decode")

    def poll(self) -> ConnectorEvents:
        """Transfers that ended since the last step: received (decode now) or failed (recompute or error)."""
        events = ConnectorEvents()
        for request_id, incoming in list(self.transfers.items()):
            if incoming.state is IncomingState.RECEIVED:
                events.received[request_id] = (incoming.first_token, incoming.first_logprobs)
            elif incoming.state is IncomingState.FAILED:
                events.failed[request_id] = incoming.reason
            else:
                continue
            del self.transfers[request_id]
        return events
