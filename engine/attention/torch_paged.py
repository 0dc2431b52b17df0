"""The torch-paged attention backend (CPU): kernels.torch_paged's plans, built once per step (once per
sliding window among the model's layers), run per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.forward_context import ForwardContext
from pdserve.engine.layers.attention import Attention
from pdserve.kernels import torch_paged


@dataclass(frozen=True)
class TorchPagedMetadata:
    context: ForwardContext
    block_size: int
    store: torch_paged.StorePlan
    # by sliding window (None: full attention), made by the first layer of the step that needs them
    decode_plans: dict[int | None, torch_paged.DecodePlan] = field(default_factory=dict)
    prefill_plans: dict[int | None, list[torch_paged.PrefillSequence]] = field(default_factory=dict)

    def decode(self, window: int | None) -> torch_paged.DecodePlan:
        if window not in self.decode_plans:
            self.decode_plans[window] = torch_paged.plan_decode(
                self.context.decode_block_tables, self.context.decode_seq_lens, self.block_size,
                sliding_window=window)
        return self.decode_plans[window]

    def prefill(self, window: int | None) -> list[torch_paged.PrefillSequence]:
        if window not in self.prefill_plans:
            context = self.context
            self.prefill_plans[window] = torch_paged.plan_prefill(
                context.prefill_block_tables, context.prefill_query_start_loc, context.prefill_seq_lens,
                self.block_size, window)
        return self.prefill_plans[window]


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
        return TorchPagedMetadata(context, self.block_size, torch_paged.plan_store(context.slot_mapping))

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, layer: Attention,
                 metadata: TorchPagedMetadata) -> None:
        torch_paged.store_kv_planned(key, value, layer.key_cache, layer.value_cache, metadata.store)

    def forward_decode(self, query: torch.Tensor, layer: Attention, metadata: TorchPagedMetadata) -> torch.Tensor:
        return torch_paged.decode_attention_planned(
            query, layer.key_cache, layer.value_cache, metadata.decode(layer.sliding_window), layer.scale,
            layer.soft_cap, layer.sinks)

    def forward_prefill(self, query: torch.Tensor, layer: Attention, metadata: TorchPagedMetadata) -> torch.Tensor:
        return torch_paged.prefill_attention_planned(
            query, layer.key_cache, layer.value_cache, metadata.prefill(layer.sliding_window), layer.scale,
            layer.soft_cap, layer.sinks)
