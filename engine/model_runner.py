"""The scheduler's plan -> tensors -> forward -> logits -> sampled tokens. Owns the model and KV cache."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.selector import get_attn_backend
from pdserve.engine.attention.torch_paged import TorchPagedBackend
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_batch_sizes, context_buckets
from pdserve.engine.forward_context import ForwardContext, use_forward_context
from pdserve.engine import prompt_logprobs, structured_output
from pdserve.engine.kv_cache_groups import KVCacheGroups, group_layers_by_window
from pdserve.engine.layers.attention import Attention
from pdserve.engine.layers.sampler import Sampler
from pdserve.engine.loader import load_model
from pdserve.engine.models.registry import is_native
from pdserve.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    context: ForwardContext
    logits_indices: torch.Tensor  # [R] int64, row of the last token of each request that samples
    sampling_requests: list  # [R] the requests those rows belong to
    max_seq_len: int = 0  # longest context of the step (host-side), picks the CUDA graph's table width
    prompt_rows: list = field(default_factory=list)  # [prompt_logprobs.PromptRows] of requests that ask
    # set by the forward: {request id: this step's prompt-logprob tables}
    prompt_logprobs: dict = field(default_factory=dict)


@dataclass
class StepOutput:
    sampled: dict[str, tuple[int, dict[int, float] | None]]  # request id -> (sampled token, logprobs or None)
    prompt_logprobs: dict = field(default_factory=dict)  # request id -> this step's prompt-logprob tables


def kv_cache_num_blocks(model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
                        layers_per_block: int | None = None) -> int:
    """Blocks that fit the budget: an explicit count, a byte budget, or (CUDA) a share of free memory.
    layers_per_block: the layers one block holds (a layer group's; None: every layer)."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    block_bytes = model_config.kv_bytes_per_token * cache_config.block_size
    if layers_per_block is not None:
        block_bytes = block_bytes * layers_per_block // model_config.num_layers
    budget = cache_config.memory_bytes
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1 - cache_config.gpu_memory_utilization))
    if budget is None:
        budget = _CPU_DEFAULT_KV_BYTES
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise MemoryError(
            f"the KV cache budget ({budget} bytes) holds no block of {block_bytes} bytes: raise the memory "
            "budget or lower block_size"
        )
    return int(num_blocks)


def _attn_backend_for(model_config: ModelConfig, device: torch.device, block_size: int) -> AttentionBackend:
    """The device's attention backend; MLA (a latent cache) runs the torch-paged backend everywhere, since
    the Triton kernels read K/V caches only."""
    if model_config.is_mla:
        if device.type == "cuda":
            logger.info("MLA attention runs pdserve's torch path on %s (the Triton kernels do not read a latent "
                        "cache)", device)
        return TorchPagedBackend(block_size)
    return get_attn_backend(device, block_size)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str | torch.device = "cpu",
                 max_num_seqs: int | None = None) -> None:
        """A model whose layers do not all have one sliding window keeps each layer group's KV in its own block
        table (engine/kv_cache_groups.py); else one table serves every layer."""
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = torch.device(device)
        self.block_size = cache_config.block_size
        # Chosen once: every layer's attention, norms and rotary run this backend's kernels.
        self.attn_backend = _attn_backend_for(model_config, self.device, self.block_size)
        logger.info("computing in %s (%s)", str(model_config.dtype).removeprefix("torch."),
                    model_config.dtype_reason or "given")
        self.model = load_model(model_config, self.device)
        self.attn_backend.bind_layer_kernels(self.model)
        self.sampler = Sampler()
        attention_layers = sorted((m for m in self.model.modules() if isinstance(m, Attention)),
                                  key=lambda layer: layer.layer_idx)
        self.kv_groups: KVCacheGroups | None = None
        if not model_config.is_mla:
            self.kv_groups = group_layers_by_window([layer.sliding_window for layer in attention_layers])
        layers_per_block = None if self.kv_groups is None else self.kv_groups.layers_per_group
        self.num_blocks = kv_cache_num_blocks(model_config, cache_config, self.device, layers_per_block)
        # [num_layers, kv_planes, num_blocks, block_size, *kv_plane_shape], allocated once: K and V planes of
        # [num_kv_heads, head_dim], or MLA's one latent plane of [1, kv_lora_rank + qk_rope_head_dim]. With layer
        # groups, [layers_per_group, ...]: layer i of every group uses slot i, each group with its own block ids.
        shape = model_config.kv_cache_shape(self.num_blocks, self.block_size)
        if layers_per_block is not None:
            shape = (layers_per_block, *shape[1:])
        self.kv_cache = torch.zeros(shape, dtype=model_config.dtype, device=self.device)
        if self.kv_groups is None:
            self.model.bind_kv_cache(self.kv_cache, self.attn_backend)
        else:
            slots = self.kv_groups.slot_of_layer()
            for layer in attention_layers:
                layer.bind_kv_cache(self.kv_cache[slots[layer.layer_idx], 0], self.kv_cache[slots[layer.layer_idx], 1],
                                    self.attn_backend)
        # Decode-only steps up to max_num_seqs sequences replay CUDA graphs (CUDA only), else None.
        self.decode_graphs = self._build_decode_graphs(max_num_seqs or SchedulerConfig().max_num_seqs)

    def _eager_reason(self) -> str | None:
        """Why decode steps cannot use CUDA graphs here, or None when they can."""
        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device (this runner is on {self.device})"
        if self.model_config.enforce_eager:
            return "enforce_eager is set"
        if self.model_config.is_mla:
            return "MLA attention runs the torch path, which reads sequence lengths on the host"
        if self.kv_groups is not None:
            return "the model's sliding and full layers keep KV in separate block tables, which the graphs do not hold"
        if not self.attn_backend.supports_cuda_graphs:
            return (f"PDSERVE_KERNELS=torch: the {self.attn_backend.name} attention backend reads sequence lengths "
                    "on the host, which a CUDA graph cannot capture; unset it to capture graphs")
        if not is_native(self.model):
            return "the transformers backend runs eagerly (CUDA graphs are captured for native models only)"
        return None

    def _build_decode_graphs(self, max_num_seqs: int) -> DecodeGraphs | None:
        reason = self._eager_reason()
        if reason is not None:
            if self.device.type == "cuda":
                logger.info("decode steps run eagerly: %s", reason)
            return None
        started = time.perf_counter()
        graphs = DecodeGraphs(
            self.model, self.attn_backend, self.model_config.vocab_size, self.block_size, self.device,
            capture_batch_sizes(max_num_seqs), context_buckets(self.model_config.max_model_len, self.block_size),
        )
        graphs.capture()
        logger.info("captured %d decode CUDA graphs (batch sizes %s, table widths %s blocks) in %.1f s",
                    len(graphs.graphs), graphs.batch_sizes, graphs.table_widths, time.perf_counter() - started)
        return graphs

    def prepare(self, plan: SchedulerOutput) -> StepInputs:
        token_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        block_rows: list[list[int]] = []
        logits_rows: list[int] = []
        sampling_requests = []
        prompt_rows = []
        for item in plan.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            rows = prompt_logprobs.rows_of_chunk(request, start, end, len(token_ids))
            if rows is not None:
                prompt_rows.append(rows)
            token_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            seq_lens.append(end)
            query_lens.append(item.num_new_tokens)
            block_rows.append(item.block_ids)
            if item.samples:
                logits_rows.append(len(token_ids) - 1)
                sampling_requests.append(request)
        inputs = self._to_tensors(plan.num_decodes, token_ids, positions, seq_lens, query_lens, block_rows,
                                  logits_rows, sampling_requests)
        inputs.prompt_rows = prompt_rows
        return inputs

    def _to_tensors(self, num_decodes, token_ids, positions, seq_lens, query_lens, block_rows,
                    logits_rows, sampling_requests) -> StepInputs:
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        # which sequence each token belongs to, then slot = block_table[seq, pos // B] * B + pos % B
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        prefill_lens = torch.tensor([0] + query_lens[num_decodes:], dtype=torch.int32)
        shared = (num_decodes, seq_lens_t, positions_t, seq_of_token,
                  torch.cumsum(prefill_lens, 0, dtype=torch.int32).to(self.device))
        if self.kv_groups is None:
            context = self._table_context(block_rows, *shared)
        else:  # block_rows: each request's block ids per group
            groups = [self._table_context([row[group] for row in block_rows], *shared)
                      for group in range(len(self.kv_groups.groups))]
            context = dataclasses.replace(groups[0], group_contexts=tuple(groups),
                                          group_of_layer=self.kv_groups.group_of_layer())
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=positions_t.to(self.device),
            context=context,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=self.device),
            sampling_requests=sampling_requests,
            max_seq_len=max(seq_lens),
        )

    def _table_context(self, block_rows, num_decodes, seq_lens_t, positions_t, seq_of_token,
                       prefill_query_start_loc) -> ForwardContext:
        """The step's context over one block table (block_rows: each request's block ids)."""
        width = max(len(row) for row in block_rows)
        block_tables = torch.tensor([row + [0] * (width - len(row)) for row in block_rows], dtype=torch.int32)
        slot_mapping = (
            block_tables[seq_of_token, positions_t // self.block_size].long() * self.block_size
            + positions_t % self.block_size
        )
        device = self.device
        return ForwardContext(
            slot_mapping=slot_mapping.to(device),
            num_decode_tokens=num_decodes,
            decode_block_tables=block_tables[:num_decodes].to(device),
            decode_seq_lens=seq_lens_t[:num_decodes].to(device),
            prefill_block_tables=block_tables[num_decodes:].to(device),
            prefill_query_start_loc=prefill_query_start_loc,
            prefill_seq_lens=seq_lens_t[num_decodes:].to(device),
        )

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None) -> StepOutput:
        """Run one step: the sampled tokens of requests that sample, and the prompt logprobs of the
        chunks that ask for them. on_layer_stored(layer_idx) runs as soon as each layer's new K/V is in
        the cache."""
        if plan.is_empty:
            return StepOutput({})
        inputs = self.prepare(plan)
        logits = self.step_logits(inputs, on_layer_stored)  # [R, vocab]
        if not inputs.sampling_requests:
            return StepOutput({}, inputs.prompt_logprobs)
        if any(request.grammar is not None for request in inputs.sampling_requests):
            logits = structured_output.mask_logits(logits, inputs.sampling_requests)
        result = self.sampler(logits, inputs.sampling_requests)
        sampled = {
            request.request_id: (token, logprobs)
            for request, token, logprobs in zip(inputs.sampling_requests, result.token_ids, result.logprobs)
        }
        return StepOutput(sampled, inputs.prompt_logprobs)

    @torch.inference_mode()
    def step_logits(self, inputs: StepInputs, on_layer_stored: Callable[[int], None] | None = None,
                    eager: bool = False) -> torch.Tensor | None:
        """Run the step's forward (KV written); logits [R, vocab] of the rows that sample, None if none.
        Decode-only steps that fit a captured graph replay it (unless eager); the rest run eagerly, and
        fill inputs.prompt_logprobs for the chunks that ask for them."""
        graphs, context = self.decode_graphs, inputs.context
        decode_only = context.num_decode_tokens == context.num_tokens and not inputs.prompt_rows
        if (graphs is not None and not eager and on_layer_stored is None and decode_only
                and graphs.can_run(context.num_decode_tokens, inputs.max_seq_len)):
            logits = graphs.run(inputs.input_ids, inputs.positions, context, inputs.max_seq_len)  # [n, vocab]
            return logits.index_select(0, inputs.logits_indices) if inputs.sampling_requests else None
        context.on_layer_stored = on_layer_stored
        with use_forward_context(context, self.attn_backend):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        if inputs.prompt_rows:
            inputs.prompt_logprobs = prompt_logprobs.compute(self.model, hidden, inputs.prompt_rows)
        if not inputs.sampling_requests:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))  # [R, vocab]
