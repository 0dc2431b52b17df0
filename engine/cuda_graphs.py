"""CUDA graphs for decode-only steps: capture once at start-up, replay every step.

A decode step of a small model is mostly kernel-launch overhead on a GPU. DecodeGraphs captures the
decode forward (model forward + compute_logits of every row) once per (batch size, context bucket)
over static input buffers; a step copies its values into the first rows of those buffers, marks the
remaining rows as padding, replays, and reads back the first rows of the logits. Sampling stays
eager. Steps that prefill, that stream KV layer by layer (ForwardContext.on_layer_stored) or that
are larger than the largest captured batch run eagerly in ModelRunner.

Padding rows are harmless by construction: slot -1 (store_kv skips it) and seq_len 0 (paged decode
attention returns zeros for an empty sequence, without reading the block table).

Context buckets: the Triton decode kernel chooses its split-K partitioning on the host from the
block-table width (max_blocks * block_size), and a graph freezes that choice. One table width for
every step would make short contexts pay for max_model_len, so each batch size is captured at a few
widths (context_buckets()) and a step uses the narrowest one that holds its longest sequence.

use_cuda_graphs=False keeps every buffer and the padding but runs the captured function eagerly at
replay: the same code path minus torch.cuda.graph, which is how the CPU tests check it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.forward_context import ForwardContext, use_forward_context

# Batch sizes captured by default: 1, 2, 4, then steps of 8 to 64, 16 to 128, 32 to 256, 64 to 512.
# Small batches pad by up to 7 rows, which costs little (their matmuls are bound by reading the
# weights); past 64 the padding stays under a quarter of the batch. Capped at max_num_seqs.
_BATCH_LADDER = (1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, 257, 32), *range(320, 513, 64))
MAX_CAPTURED_BATCH_SIZE = _BATCH_LADDER[-1]


def capture_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The default batch sizes to capture: the ladder up to max_num_seqs, plus max_num_seqs itself
    (capped at MAX_CAPTURED_BATCH_SIZE; larger batches run eagerly)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be at least 1")
    cap = min(max_num_seqs, MAX_CAPTURED_BATCH_SIZE)
    return tuple(sorted({size for size in _BATCH_LADDER if size <= cap} | {cap}))


def context_buckets(max_model_len: int, block_size: int) -> tuple[int, ...]:
    """Block-table widths (in blocks) to capture, narrowest first.

    Candidates double from the kernel's shortest partition up to max_model_len. A candidate is kept
    when the kernel tiles it differently from the next wider one: when it runs unsplit, or when the
    partition size changes. Between those, a wider table only adds partitions that exit at once.
    """
    from pdserve.kernels.triton_decode_attention import MIN_PARTITION_SIZE, choose_partition_size  # imports triton

    limit = -(-max_model_len // block_size)  # blocks
    widths = []
    context = MIN_PARTITION_SIZE
    while -(-context // block_size) < limit:
        widths.append(-(-context // block_size))
        context *= 2
    kept = [limit]
    for width, wider in zip(widths, [*widths[1:], limit]):
        size, wider_size = choose_partition_size(width * block_size), choose_partition_size(wider * block_size)
        if size >= width * block_size or size != wider_size:  # unsplit, or tiled unlike the next width
            kept.append(width)
    return tuple(sorted(set(kept)))


@dataclass
class DecodeGraph:
    """One captured shape: views of the shared static buffers, and the graph replaying over them."""

    batch_size: int
    num_table_blocks: int  # block-table width: holds contexts up to num_table_blocks * block_size
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    context: ForwardContext  # decode-only, over the static slot_mapping / block tables / seq lens
    cuda_graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Decode graphs over one set of static buffers. Build, `capture()` once, then `run()` per step."""

    def __init__(
        self,
        model: nn.Module,  # forward(input_ids, positions) -> hidden; compute_logits(hidden) -> [R, vocab]
        attn_backend: AttentionBackend,  # the one the model's layers are bound to
        vocab_size: int,
        block_size: int,
        device: torch.device,
        batch_sizes: Sequence[int],
        table_widths: Sequence[int],  # block-table widths in blocks, e.g. context_buckets(...)
        use_cuda_graphs: bool = True,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1 or not table_widths or min(table_widths) < 1:
            raise ValueError(f"batch_sizes {tuple(batch_sizes)} and table_widths {tuple(table_widths)} must be "
                             "non-empty and positive")
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}: pass use_cuda_graphs=False")
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.device = device
        self.use_cuda_graphs = use_cuda_graphs
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.table_widths = tuple(sorted(set(table_widths)))
        self.replays: Counter[tuple[int, int]] = Counter()  # (batch size, table width) -> steps run
        with torch.inference_mode():
            self._allocate(vocab_size)
        self.graphs = {
            (size, width): self._make_graph(size, width) for size in self.batch_sizes for width in self.table_widths
        }

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_context(self) -> int:
        return self.table_widths[-1] * self.block_size

    def _allocate(self, vocab_size: int) -> None:
        max_batch, device = self.max_batch_size, self.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # One flat buffer: each graph views its first B * W entries as a contiguous [B, W] table.
        self.block_tables = torch.zeros(max_batch * self.table_widths[-1], dtype=torch.int32, device=device)
        # Logits land here (inside the graph), so no graph keeps its own output alive in the pool.
        self.logits = torch.zeros(max_batch, vocab_size, dtype=torch.float32, device=device)

    def _make_graph(self, batch_size: int, width: int) -> DecodeGraph:
        device = self.device
        context = ForwardContext(
            slot_mapping=self.slot_mapping[:batch_size],
            num_decode_tokens=batch_size,
            decode_block_tables=self.block_tables[: batch_size * width].view(batch_size, width),
            decode_seq_lens=self.seq_lens[:batch_size],
            prefill_block_tables=torch.zeros((0, width), dtype=torch.int32, device=device),
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            prefill_seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        )
        return DecodeGraph(batch_size, width, self.input_ids[:batch_size], self.positions[:batch_size], context)

    # ---- capture

    def _forward(self, graph: DecodeGraph) -> None:
        """What a graph holds: the decode forward of all B rows, logits into the static buffer. The
        backend prepares the step's metadata inside it, from the static buffers."""
        with use_forward_context(graph.context, self.attn_backend):
            hidden = self.model(graph.input_ids, graph.positions)  # [B, hidden]
        self.logits[: graph.batch_size].copy_(self.model.compute_logits(hidden))  # [B, vocab]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first, into one memory pool (graphs never run concurrently,
        so each capture reuses the memory the previous one freed). Every row is padding while
        capturing: nothing is written to the KV cache. Without CUDA graphs this does nothing."""
        if not self.use_cuda_graphs:
            return
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for key in sorted(self.graphs, reverse=True):
            self._capture_one(self.graphs[key], pool, stream)
        torch.cuda.synchronize(self.device)

    def _capture_one(self, graph: DecodeGraph, pool, stream: torch.cuda.Stream) -> None:
        # Warm up on the capture stream first: Triton compiles its kernels and cuBLAS creates the
        # stream's workspace outside the capture.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(graph)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream):
            self._forward(graph)
        graph.cuda_graph = cuda_graph

    # ---- replay

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        """Whether a decode-only step of num_seqs sequences, the longest max_seq_len tokens, fits a graph."""
        return 0 < num_seqs <= self.max_batch_size and max_seq_len <= self.max_context

    def graph_for(self, num_seqs: int, max_seq_len: int) -> DecodeGraph:
        """The smallest captured batch and the narrowest table that hold the step."""
        if not self.can_run(num_seqs, max_seq_len):
            raise ValueError(
                f"a decode step of {num_seqs} sequences up to {max_seq_len} tokens fits no captured graph "
                f"(batch <= {self.max_batch_size}, context <= {self.max_context}): check can_run() first"
            )
        size = next(s for s in self.batch_sizes if s >= num_seqs)
        width = next(w for w in self.table_widths if w * self.block_size >= max_seq_len)
        return self.graphs[(size, width)]

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64, one token per sequence
        positions: torch.Tensor,  # [n] int64
        step: ForwardContext,  # the step's decode-only context: slot_mapping [n], tables [n, w], seq lens [n]
        max_seq_len: int,  # host-side max of step.decode_seq_lens
        replay: bool = True,  # False: run the captured function eagerly over the same buffers (checks)
    ) -> torch.Tensor:  # [n, vocab] float32, a view valid until the next run()
        num_seqs = int(input_ids.shape[0])
        if step.num_decode_tokens != num_seqs or step.num_tokens != num_seqs:
            raise ValueError(f"DecodeGraphs runs decode-only steps; this step has {step.num_tokens} tokens of "
                             f"which {step.num_decode_tokens} decode: run it eagerly")
        graph = self.graph_for(num_seqs, max_seq_len)
        self._fill(graph, input_ids, positions, step)
        if graph.cuda_graph is not None and replay:
            graph.cuda_graph.replay()
        else:
            self._forward(graph)
        self.replays[(graph.batch_size, graph.num_table_blocks)] += 1
        return self.logits[:num_seqs]

    def _fill(self, graph: DecodeGraph, input_ids, positions, step: ForwardContext) -> None:
        """Real rows first; padding rows get slot -1 and seq_len 0. Stale ids, positions and table
        entries elsewhere are valid values from earlier steps and are never read through."""
        n, size = int(input_ids.shape[0]), graph.batch_size
        width = min(int(step.decode_block_tables.shape[1]), graph.num_table_blocks)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(step.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(step.decode_seq_lens)
        self.seq_lens[n:size].zero_()
        graph.context.decode_block_tables[:n, :width].copy_(step.decode_block_tables[:, :width])
