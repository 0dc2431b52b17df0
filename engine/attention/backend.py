"""The attention backend interface: `prepare` once per step, `forward` once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch
from torch import nn

from pdserve.engine.forward_context import ForwardContext, get_forward_context

if TYPE_CHECKING:
    from pdserve.engine.layers.attention import Attention

MetadataT = TypeVar("MetadataT")


class AttentionBackend(ABC, Generic[MetadataT]):
    """Chosen once per model runner (selector.get_attn_backend). use_forward_context() calls
    prepare(); every Attention layer bound to the backend calls forward()."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool]  # a captured decode step replays correctly
    # A decode step reads every sequence's KV padded to the step's longest context: its attention costs
    # batch x longest, not the sum of the contexts (what `pdserve profile` records for the planner).
    decode_pads_to_longest: ClassVar[bool] = False
    # A decode step groups its sequences by length (kernels.length_groups.group_by_length) and reads each group padded
    # to its longest: it costs the sum of the contexts plus the groups' padding.
    decode_groups_by_length: ClassVar[bool] = False

    @abstractmethod
    def prepare(self, context: ForwardContext) -> MetadataT:
        """What every layer of the step shares, built from the step's metadata."""

    @abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, layer: Attention, metadata: MetadataT) -> None:
        """Write the step's new K/V ([T, num_kv_heads, head_dim] each) into the layer's cache."""

    @abstractmethod
    def forward_decode(self, query: torch.Tensor, layer: Attention, metadata: MetadataT) -> torch.Tensor:
        """query [num_decodes, num_heads, head_dim] -> same shape, over each sequence's cached context."""

    @abstractmethod
    def forward_prefill(self, query: torch.Tensor, layer: Attention, metadata: MetadataT) -> torch.Tensor:
        """query [num_prefill_tokens, num_heads, head_dim] -> same shape, causal over each paged prefix."""

    def bind_layer_kernels(self, model: nn.Module) -> None:
        """Give the model's RMSNorm and rotary modules this backend's kernels (default: their torch code)."""

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim], rotary applied
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        layer: Attention,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        context = get_forward_context()
        metadata = context.layer_metadata(layer.layer_idx)
        self.store_kv(key, value, layer, metadata)
        if context.on_layer_stored is not None:
            context.on_layer_stored(layer.layer_idx)
        num_decode = context.num_decode_tokens
        if num_decode == query.shape[0]:
            out = self.forward_decode(query, layer, metadata)
        elif num_decode == 0:
            out = self.forward_prefill(query, layer, metadata)
        else:
            out = torch.cat((self.forward_decode(query[:num_decode], layer, metadata),
                             self.forward_prefill(query[num_decode:], layer, metadata)))
        return out.flatten(1)
