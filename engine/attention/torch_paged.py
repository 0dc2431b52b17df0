"""The torch-paged attention backend (CPU): kernels.torch_paged's plans, built once per step (once per
sliding window among the model's layers), run per layer. Decode reads the paged cache in place through the
CPU's native kernel (kernels.cpu_native) where it builds, else through the gathering torch plan; bfloat16 prefill
runs on the native AVX512-BF16 kernel (kernels.cpu_prefill) where the CPU has it, else on the gather and SDPA."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.forward_context import ForwardContext
from pdserve.engine.layers.attention import Attention
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models import cpu_decode_layers
from pdserve.kernels import cpu_native, cpu_norm_rotary, cpu_prefill, torch_paged

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchPagedMetadata:
    context: ForwardContext
    block_size: int
    # by sliding window (None: full attention), made by the first layer of the step that needs them
    decode_plans: dict[int | None, torch_paged.DecodePlan] = field(default_factory=dict)
    prefill_plans: dict[int | None, list[torch_paged.PrefillSequence]] = field(default_factory=dict)

    @functools.cached_property
    def store(self) -> torch_paged.StorePlan:  # the torch store's plan: made only where a layer stores through torch
        return torch_paged.plan_store(self.context.slot_mapping)

    @functools.cached_property
    def native_decode_args(self) -> tuple[torch.Tensor, torch.Tensor]:  # int32 [S, max_blocks], [S], contiguous
        context = self.context
        return (context.decode_block_tables.to(torch.int32).contiguous(),
                context.decode_seq_lens.to(torch.int32).contiguous())

    @functools.cached_property
    def native_prefill_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # int32, contiguous
        context = self.context
        return tuple(tensor.to(torch.int32).contiguous() for tensor in (
            context.prefill_block_tables, context.prefill_query_start_loc, context.prefill_seq_lens))

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
    # The native decode kernel reads each sequence's own context; the torch plan groups the step's sequences by
    # length (kernels.length_groups.group_by_length bounds each group's padding to 10% of its tokens or 256
    # tokens), so a step reads the sum of its contexts and that padding (decode_groups_by_length, set below).
    decode_pads_to_longest = False

    def __init__(self, block_size: int, native: bool = True) -> None:  # native False: torch ops only
        self.block_size = block_size
        self.native_decode = native and cpu_native.decode_kernel() is not None
        self.decode_groups_by_length = not self.native_decode
        self.native_prefill = native and cpu_prefill.prefill_kernel() is not None
        if native:
            reason = cpu_native.unavailable_reason()
            logger.info("CPU decode attention: %s", "the native paged kernel" if reason is None else
                        f"torch ops with a gather copy ({reason})")
            reason = cpu_prefill.unavailable_reason()
            logger.info("CPU bfloat16 prefill attention: %s", "the native AVX512-BF16 kernel" if reason is None else
                        f"a gather and torch's SDPA ({reason})")

    def bind_layer_kernels(self, model: nn.Module) -> None:
        """bfloat16 RMSNorms and rotations in one native call each where cpu_norm_rotary.c builds (other dtypes
        keep their torch code inside the same functions); then, where the model allows, decode steps through all
        its layers in one native call (engine/models/cpu_decode_layers.py)."""
        if not cpu_norm_rotary.available():
            return
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.use_kernel(cpu_norm_rotary.add_rms_norm)
            elif isinstance(module, RotaryEmbedding):
                module.use_native_rotate(cpu_norm_rotary.rotate)
        if self.native_decode:
            cpu_decode_layers.bind(model)

    def prepare(self, context: ForwardContext) -> TorchPagedMetadata:
        return TorchPagedMetadata(context, self.block_size)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, layer: Attention,
                 metadata: TorchPagedMetadata) -> None:
        if self.native_decode and cpu_native.store_kv(key, value, layer.key_cache, layer.value_cache,
                                                      metadata.context.slot_mapping):
            return
        torch_paged.store_kv_planned(key, value, layer.key_cache, layer.value_cache, metadata.store)

    def forward_decode(self, query: torch.Tensor, layer: Attention, metadata: TorchPagedMetadata) -> torch.Tensor:
        if self.native_decode and cpu_native.supports(query, layer.key_cache, layer.value_cache):
            block_tables, seq_lens = metadata.native_decode_args
            return cpu_native.paged_decode(query, layer.key_cache, layer.value_cache, block_tables, seq_lens,
                                           layer.scale, layer.sliding_window, layer.soft_cap, layer.sinks)
        return torch_paged.decode_attention_planned(
            query, layer.key_cache, layer.value_cache, metadata.decode(layer.sliding_window), layer.scale,
            layer.soft_cap, layer.sinks)

    def forward_prefill(self, query: torch.Tensor, layer: Attention, metadata: TorchPagedMetadata) -> torch.Tensor:
        if self.native_prefill and cpu_prefill.supports(query, layer.key_cache, layer.value_cache, layer.soft_cap,
                                                        layer.sinks):
            return cpu_prefill.paged_prefill(query, layer.key_cache, layer.value_cache, *metadata.native_prefill_args,
                                             layer.scale, layer.sliding_window)
        return torch_paged.prefill_attention_planned(
            query, layer.key_cache, layer.value_cache, metadata.prefill(layer.sliding_window), layer.scale,
            layer.soft_cap, layer.sinks)
