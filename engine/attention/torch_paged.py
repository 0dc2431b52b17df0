"""The torch-paged attention backend (CPU): kernels.torch_paged's plans, built once per step, run per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.forward_context import ForwardContext
from pdserve.engine.layers.attention import Attention
from pdserve.kernels import torch_paged


@dataclass(frozen=True)
class TorchPagedMetadata:
    store: torch_paged.StorePlan
    decode: torch_paged.DecodePlan | None  # None: the step has no decodes
    prefill: list[torch_paged.PrefillSequence] | None  # None: the step has no prefill tokens


class TorchPagedBackend(AttentionBackend[TorchPagedMetadata]):
    name = "torch-paged"
    supports_cuda_graphs = False  # the plans read sequence lengths on the host
    # Decode groups the step's sequences by length (kernels.length_groups.group_by_length bounds each group's
    # padding to 10% of its tokens or 256 tokens), so a step reads the sum of its contexts and that padding.
    decode_pads_to_longest = False
    decode_groups_by_length = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(self, context: ForwardContext) -> TorchPagedMetadata:
        num_decodes = context.num_decode_tokens
        decode = prefill = None
        if num_decodes > 0:
            decode = torch_paged.plan_decode(context.decode_block_tables, context.decode_seq_lens, self.block_size)
        if context.num_tokens > num_decodes:
            prefill = torch_paged.plan_prefill(context.prefill_block_tables, context.prefill_query_start_loc,
                                               context.prefill_seq_lens, self.block_size)
        return TorchPagedMetadata(torch_paged.plan_store(context.slot_mapping), decode, prefill)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, layer: Attention,
                 metadata: TorchPagedMetadata) -> None:
        torch_paged.store_kv_planned(key, value, layer.key_cache, layer.value_cache, metadata.store)

    def forward_decode(self, query: torch.Tensor, layer: Attention, metadata: TorchPagedMetadata) -> torch.Tensor:
        return torch_paged.decode_attention_planned(
            query, layer.key_cache, layer.value_cache, metadata.decode, layer.scale)

    def forward_prefill(self, query: torch.Tensor, layer: Attention, metadata: TorchPagedMetadata) -> torch.Tensor:
        return torch_paged.prefill_attention_planned(
            query, layer.key_cache, layer.value_cache, metadata.prefill, layer.scale)
