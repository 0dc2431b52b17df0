"""KVLayer frames into the decode engine's cache: checked against the layout and the request's
KVWant, then written straight into the request's blocks."""

from __future__ import annotations

import torch

from pdserve.decode.incoming import IncomingTransfer
from pdserve.engine.cpu_threads import one_cpu_thread
from pdserve.kernels.dispatch import kernel_for
from pdserve.kvtransfer.messages import KVLayer


class KVWriter:
    """Writes into one cache [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] with the
    kernels of its device, chosen once."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._kv_unpack = kernel_for("kv_unpack", kv_cache.device)
        self._store_kv = kernel_for("store_kv", kv_cache.device)

    def layer_problem(self, incoming: IncomingTransfer, msg: KVLayer) -> str | None:
        """Why msg cannot go into this cache for this transfer; None if it can."""
        num_layers, _, _, _, num_kv_heads, head_dim = self.kv_cache.shape
        expected_dtype = str(self.kv_cache.dtype).removeprefix("torch.")
        if msg.layer_end > num_layers:
            return f"KV for layers up to {msg.layer_end}, the model has {num_layers}"
        if msg.token_start + msg.num_tokens > incoming.num_tokens:
            return f"KV for tokens up to {msg.token_start + msg.num_tokens}, only {incoming.num_tokens} were asked for"
        if tuple(msg.shape[3:]) != (num_kv_heads, head_dim) or msg.dtype != expected_dtype:
            return (f"KV of shape {list(msg.shape)} {msg.dtype}, expected [.., {num_kv_heads}, {head_dim}] "
                    f"{expected_dtype}")
        return None

    def write(self, incoming: IncomingTransfer, msg: KVLayer, kv: torch.Tensor) -> None:
        """kv [num_layers, 2, T, kv_heads, head_dim] -> the request's blocks at its token positions."""
        kv_cache = self.kv_cache
        device, block_size = kv_cache.device, kv_cache.shape[3]
        first = incoming.skip_tokens + msg.token_start  # prompt position of the message's first token
        kv = kv.to(device, non_blocking=True)
        with one_cpu_thread(device):
            if first % block_size == 0:  # starts on a block boundary: one scatter for all its layers
                blocks = incoming.block_ids[first // block_size:].to(device)
                self._kv_unpack(kv, kv_cache, blocks, msg.num_tokens, msg.layer_start)
                return
            positions = first + torch.arange(msg.num_tokens)  # a chunk that starts mid-block
            slots = (incoming.block_ids[positions // block_size] * block_size + positions % block_size).to(device)
            for offset in range(msg.layer_end - msg.layer_start):
                layer = kv_cache[msg.layer_start + offset]
                self._store_kv(kv[offset, 0], kv[offset, 1], layer[0], layer[1], slots)
