"""Reads a prompt's KV out of the prefill engine's cache and sends it as KVLayer messages, then KVDone.
Each layer sends the tokens it carries (kvtransfer.layout: a sliding-window layer only its window's
blocks), from its layer group's blocks when the cache has layer groups. Every KVLayer goes through
`KVSender.send_layer`, which counts the bytes sent."""

from __future__ import annotations

import math

import torch

from pdserve.engine.cpu_threads import one_cpu_thread
from pdserve.engine.kv_cache_groups import BlockIds, CacheLayers
from pdserve.engine.kv_connector import KVConnectorStats
from pdserve.kernels.dispatch import kernel_for
from pdserve.kvtransfer.layout import LayerSpan, LinkLayout
from pdserve.kvtransfer.messages import KVDone, KVLayer
from pdserve.kvtransfer.payload import combine_checksums
from pdserve.control.sockets import ServerSocket
from pdserve.prefill.transfers import Transfer

MESSAGE_TARGET_BYTES = 4 << 20  # group layers so each KVLayer frame is about this big (fewer, larger sends)


class KVSender:
    def __init__(self, server: ServerSocket, stats: KVConnectorStats) -> None:
        self.server = server
        self.stats = stats
        # [layer slots, planes, num_blocks, block_size, *per_token]: a slot per layer, or per layer of a group
        self.kv_cache: torch.Tensor | None = None
        self.layers: CacheLayers | None = None  # each model layer's slot and block table
        self._kv_pack = None  # the cache device's kv_pack, chosen when the cache is bound

    def bind_kv_cache(self, kv_cache: torch.Tensor, layers: CacheLayers) -> None:
        self.kv_cache, self.layers, self._kv_pack = kv_cache, layers, kernel_for("kv_pack", kv_cache.device)

    def slots(self, block_ids: BlockIds, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Cache slots of prompt tokens [start, end) in each block table of get_block_ids' block_ids:
        per table, [end - start] int64."""
        block_size = self.kv_cache.shape[3]
        positions = torch.arange(start, end)
        tables = [torch.tensor(ids, dtype=torch.int64) for ids in self.layers.tables(block_ids)]
        return tuple((table[positions // block_size] * block_size + positions % block_size).to(self.kv_cache.device)
                     for table in tables)

    def gather(self, layer_start: int, layer_end: int, slots: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """KV of layers [layer_start, layer_end) at each table's cache slots [T], on the cache's device:
        [layers, planes, T, *per_token]."""
        with one_cpu_thread(self.kv_cache.device):
            parts = [self.kv_cache[run.slot:run.slot_end].flatten(2, 3).index_select(2, slots[run.group])
                     for run in self.layers.runs(layer_start, layer_end)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def pack(self, tables: list[torch.Tensor], num_tokens: int, layer_start: int, layer_end: int) -> torch.Tensor:
        """KV of layers [layer_start, layer_end) of the first num_tokens tokens of each table's blocks (whole
        blocks from offset 0): [layers, planes, num_tokens, *per_token]."""
        with one_cpu_thread(self.kv_cache.device):
            parts = [self._kv_pack(self.kv_cache, tables[run.group], num_tokens, run.slot, run.slot_end)
                     for run in self.layers.runs(layer_start, layer_end)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def send_range(self, transfer: Transfer, block_ids: BlockIds, start: int, end: int) -> None:
        """What every layer carries of prompt tokens [start, end), from the cache, in ~4 MiB messages.
        block_ids: the request's get_block_ids (a table per layer group with groups)."""
        spans = LinkLayout.spans(transfer.first_positions, 0, self.layers.num_layers, start, end)
        for span in spans:
            self._send_span(transfer, block_ids, span)
        transfer.sent_upto = max(transfer.sent_upto, end)

    def _send_span(self, transfer: Transfer, block_ids: BlockIds, span: LayerSpan) -> None:
        """Tokens [span.start, span.end) of the span's layers, a group of layers per message."""
        start, end = span.start, span.end
        per_layer = self.kv_cache[0, :, 0, 0].numel() * (end - start) * self.kv_cache.element_size()
        step = max(1, min(span.num_layers, math.ceil(MESSAGE_TARGET_BYTES / per_layer)))
        block_size = self.kv_cache.shape[3]
        aligned = start % block_size == 0
        tables = [torch.tensor(ids[start // block_size:], dtype=torch.int64, device=self.kv_cache.device)
                  for ids in self.layers.tables(block_ids)]
        slots = None if aligned else self.slots(block_ids, start, end)
        for layer_start in range(span.layer_start, span.layer_end, step):
            layer_end = min(span.layer_end, layer_start + step)
            if aligned:  # whole blocks: [layers, planes, T, *per_token]
                kv = self.pack(tables, end - start, layer_start, layer_end)
            else:
                kv = self.gather(layer_start, layer_end, slots)
            self.send_payload(transfer, kv.cpu(), layer_start, start)

    def send_payload(self, transfer: Transfer, kv: torch.Tensor, layer_start: int, position: int) -> None:
        """kv [layers, planes, T, *per_token] on the host: prompt tokens from `position` on."""
        msg, payload = KVLayer.from_tensor(kv, request_id=transfer.request_id, layer_start=layer_start,
                                           token_start=position - transfer.skip_tokens)
        transfer.checksums.append(msg.checksum)
        self.send_layer(transfer.peer_id, msg, payload)

    def send_layer(self, peer_id: bytes, msg: KVLayer, payload: memoryview) -> None:
        self.server.send(peer_id, msg, payload)
        self.stats.kv_bytes_sent += msg.nbytes

    def send_done(self, transfer: Transfer) -> None:
        """KVDone: the first token sampled here and the checksum over every KVLayer sent."""
        request = transfer.request
        self.server.send(transfer.peer_id, KVDone(
            request_id=transfer.request_id, first_token=request.output_token_ids[0], num_tokens=transfer.num_tokens,
            checksum=combine_checksums(transfer.checksums),
            first_logprobs=request.logprobs[0] if request.logprobs else None))
