"""KVLayer frames into the decode engine's cache: checked against the layout and the request's
KVWant (a sliding-window layer takes only the tokens of its window, kvtransfer.layout), then written
straight into the request's blocks (each layer into its layer group's blocks when the cache has groups)."""

from __future__ import annotations

import torch

from pdserve.decode.incoming import IncomingTransfer
from pdserve.engine.cpu_threads import one_cpu_thread
from pdserve.engine.kv_cache_groups import CacheLayers
from pdserve.kernels.dispatch import kernel_for
from pdserve.kvtransfer.messages import KVLayer


class KVWriter:
    """Writes into one cache [layer slots, planes, num_blocks, block_size, *per_token] with the kernels of
    its device, chosen once; `layers` says each model layer's slot and block table (default: slot i for
    layer i, one table)."""

    def __init__(self, kv_cache: torch.Tensor, layers: CacheLayers | None = None) -> None:
        self.kv_cache = kv_cache
        self.layers = layers or CacheLayers(kv_cache.shape[0])
        self._kv_unpack = kernel_for("kv_unpack", kv_cache.device)

    def layer_problem(self, incoming: IncomingTransfer, msg: KVLayer) -> str | None:
        """Why msg cannot go into this cache for this transfer; None if it can."""
        num_layers, planes = self.layers.num_layers, self.kv_cache.shape[1]
        per_token = tuple(self.kv_cache.shape[4:])
        expected_dtype = str(self.kv_cache.dtype).removeprefix("torch.")
        if msg.layer_end > num_layers:
            return f"KV for layers up to {msg.layer_end}, the model has {num_layers}"
        if msg.token_start + msg.num_tokens > incoming.num_tokens:
            return f"KV for tokens up to {msg.token_start + msg.num_tokens}, only {incoming.num_tokens} were asked for"
        if msg.shape[1] != planes or tuple(msg.shape[3:]) != per_token or msg.dtype != expected_dtype:
            return (f"KV of shape {list(msg.shape)} {msg.dtype}, expected [.., {planes}, .., "
                    f"{', '.join(map(str, per_token))}] {expected_dtype}")
        first = incoming.skip_tokens + msg.token_start
        early = [layer for layer in range(msg.layer_start, msg.layer_end) if first < incoming.first_positions[layer]]
        if early:
            layer = early[0]
            return (f"KV of layer {layer} from prompt position {first}, before {incoming.first_positions[layer]} "
                    f"where its sliding window starts: that layer carries only its window")
        return None

    def write(self, incoming: IncomingTransfer, msg: KVLayer, kv: torch.Tensor) -> None:
        """kv [num_layers, planes, T, *per_token] -> the request's blocks at its token positions."""
        device = self.kv_cache.device
        kv = kv.to(device, non_blocking=True)
        first = incoming.skip_tokens + msg.token_start  # prompt position of the message's first token
        with one_cpu_thread(device):
            for run in self.layers.runs(msg.layer_start, msg.layer_end):  # one scatter per run of a block table
                part = kv[run.layer_start - msg.layer_start:run.layer_end - msg.layer_start]
                self._write_run(part, incoming.block_ids[run.group], first, run.slot)

    def _write_run(self, kv: torch.Tensor, block_ids: torch.Tensor, first: int, slot: int) -> None:
        """kv [layers, planes, T, *per_token] of prompt positions from `first` -> cache slots from `slot` on,
        in the blocks block_ids [num_blocks] int64."""
        kv_cache = self.kv_cache
        device, block_size, num_tokens = kv_cache.device, kv_cache.shape[3], kv.shape[2]
        if first % block_size == 0:  # starts on a block boundary: one scatter for all its layers
            self._kv_unpack(kv, kv_cache, block_ids[first // block_size:].to(device), num_tokens, slot)
            return
        positions = first + torch.arange(num_tokens)  # a chunk that starts mid-block
        slots = (block_ids[positions // block_size] * block_size + positions % block_size).to(device)
        layers = kv_cache[slot:slot + kv.shape[0]].flatten(2, 3)  # a view: [layers, planes, N * B, ...]
        layers.index_copy_(2, slots, kv.to(kv_cache.dtype))
