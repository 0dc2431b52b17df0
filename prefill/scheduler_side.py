"""Prefill role, scheduler side: a finished prompt keeps its blocks (delayed free) while its transfer
lasts, and the scheduler hears which blocks may go and which requests the decode engine gave up on.
No sockets: a computed prompt that was already asked for is handed to the transfer side, which sends it
after the step's first tokens have gone to the router."""

from __future__ import annotations

import logging

from pdserve.engine.kv_cache_groups import BlockIds
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector
from pdserve.engine.request import Request, RequestStatus
from pdserve.prefill.transfer_side import PrefillTransferSide
from pdserve.prefill.transfers import Transfer, TransferState

log = logging.getLogger("pdserve.prefill.scheduler_side")


class PrefillSchedulerSide(KVConnector):
    def __init__(self, transfer_side: PrefillTransferSide) -> None:
        self.transfer_side = transfer_side
        self.transfers = transfer_side.transfers

    def on_request_finished(self, request: Request, block_ids: BlockIds) -> bool:
        """Whether the finished prompt's blocks wait for a decode engine (True) or may go now."""
        request_id = request.request_id
        transfer = self.transfers.get(request_id)
        ends_here = self.transfer_side.first_token_ends(request_id)
        held = self.transfer_side.take_hold(request_id)
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) or (
                transfer is not None and transfer.is_ended):
            if self.transfers.pop(request_id, None) is not None:
                self.transfer_side.forget(transfer)
            return False
        if transfer is None:
            if ends_here and not held:  # no decode engine has it: nobody will ask for this KV
                return False
            self.transfers[request_id] = transfer = Transfer.computed(request, block_ids)
            transfer.held_by = held
            return True
        transfer.prompt_computed(request, block_ids)
        self.transfer_side.computed.append(transfer)  # sent once the step's first tokens are out
        return True

    def on_request_aborted(self, request: Request) -> None:
        self.transfer_side.take_hold(request.request_id)
        transfer = self.transfers.pop(request.request_id, None)
        if transfer is not None:
            transfer.move(TransferState.ABORTED, "aborted")  # its layers still queued are not sent
            self.transfer_side.forget(transfer)

    def poll(self) -> ConnectorEvents:
        """Ended transfers: the blocks of a computed prompt may go; a request the decode engine
        aborted is aborted here too."""
        events = ConnectorEvents()
        for request_id, transfer in list(self.transfers.items()):
            if transfer.state is TransferState.ABORTED:
                events.aborted.add(request_id)
            elif transfer.is_ended and transfer.request is not None:
                log.debug("releasing blocks of %s: %s", request_id, transfer.reason)
                events.sent.add(request_id)
            else:
                continue
            del self.transfers[request_id]
            self.transfer_side.forget(transfer)
        return events
