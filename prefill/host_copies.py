"""Streamed layer ranges on their way to host memory, sent in the order they were stored.

On CUDA the gather runs on the compute stream and the copy into pinned memory on a side stream, so it
overlaps the next layers' kernels; a range is sent once its copy has landed, and none overtakes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pdserve.prefill.transfers import Transfer


@dataclass
class StreamedLayers:
    """Layers [layer_start, layer_start + kv.shape[0]) of a transfer's tokens from `position` on."""

    transfer: Transfer
    layer_start: int
    position: int  # prompt position of its first token
    kv: torch.Tensor  # [layers, planes, T, *per_token] on the CPU (pinned when it comes from CUDA)
    ready: Any = None  # torch.cuda.Event recorded after the copy; None: already on the host


class HostCopies:
    def __init__(self, send: Callable[[StreamedLayers], None]) -> None:
        self._send = send
        self._queue: deque[StreamedLayers] = deque()  # in send order
        self._copy_stream = None  # CUDA: the side stream of the device-to-host copies, made on first use

    def __len__(self) -> int:
        return len(self._queue)

    def copy(self, transfer: Transfer, kv: torch.Tensor, layer_start: int, position: int) -> None:
        """Queue kv [layers, planes, T, *per_token] (on the cache's device) for sending; on CUDA its
        copy to the host starts now and the host does not wait for it here."""
        ready = None
        if kv.device.type == "cuda":
            kv, ready = self._copy_on_side_stream(kv)
        self.append(StreamedLayers(transfer, layer_start, position, kv, ready))

    def append(self, streamed: StreamedLayers) -> None:
        self._queue.append(streamed)

    def send_landed(self, wait: bool) -> None:
        """Send the ranges whose copy has landed, oldest first; with `wait`, all of them."""
        while self._queue:
            streamed = self._queue[0]
            if streamed.ready is not None and not streamed.ready.query():
                if not wait:
                    return  # keep the order: later copies wait behind this one
                streamed.ready.synchronize()
            self._queue.popleft()
            self._send(streamed)

    def _copy_on_side_stream(self, kv: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(pinned host copy of kv, event recorded when it has landed)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=kv.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(kv.device))  # kv is gathered by then
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        kv.record_stream(self._copy_stream)  # its memory is not reused before the side stream has read it
        return host, ready
