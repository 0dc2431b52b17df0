"""CPU decode attention grouped by length against the former padded version (one gather + SDPA padded to
the step's longest context), in one process, alternating, medians, one thread:

    python -m pdserve.bench.decode_attention_groups [--model DIR] [--batch 8 --batch 20 --batch 32]
        [--repeats 15] [--no-step]

Per layer: kernels.torch_paged's decode attention at the demo model's attention shape (9 heads, 3 KV
heads, head_dim 64, block 16). Whole step: the demo model's engine (every layer, sampling included)
with its requests' contexts spread 128..384 or all 256 tokens, decode steps alternating between the two
versions. Ratio = grouped / padded time.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine.attention.torch_paged import TorchPagedMetadata
from pdserve.kernels import torch_paged

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SPREADS = {"spread 128..384": (128, 384), "uniform 256": (256, 256)}


@dataclasses.dataclass(frozen=True)
class PaddedPlan:  # the former plan: every sequence padded to the step's longest context
    num_seqs: int
    max_len: int
    block_ids: torch.Tensor  # [S * ceil(max_len / B)] int64
    mask: torch.Tensor | None  # [S, 1, 1, max_len] bool


def padded_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PaddedPlan:
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    mask = None
    if bool((seq_lens != max_len).any()):
        mask = (torch.arange(max_len)[None, :] < seq_lens[:, None])[:, None, None, :]
    return PaddedPlan(int(seq_lens.shape[0]), max_len, block_tables[:, :num_blocks].reshape(-1).long(), mask)


def padded_attention(query, key_cache, value_cache, plan: PaddedPlan, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape

    def gather(cache):
        blocks = cache.index_select(0, plan.block_ids).view(num_seqs, -1, *cache.shape[2:])[:, :plan.max_len]
        return blocks.transpose(1, 2).float()

    out = F.scaled_dot_product_attention(
        query.float().view(num_seqs, num_heads, 1, head_dim), gather(key_cache), gather(value_cache),
        attn_mask=plan.mask, scale=scale, enable_gqa=num_heads != key_cache.shape[2])
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def context_lens(batch: int, low: int, high: int) -> list[int]:
    """Evenly spread from high down to low (the same lengths every run)."""
    return [round(high - (high - low) * i / max(batch - 1, 1)) for i in range(batch)]


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def layer_case(batch: int, lens: list[int], repeats: int, calls: int) -> tuple[float, float]:
    """(padded ms, grouped ms) per layer call, medians of alternating rounds."""
    num_blocks_each = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens]
    num_blocks = sum(num_blocks_each) + 1
    gen = torch.Generator().manual_seed(batch)
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(batch, max(num_blocks_each), dtype=torch.int32)
    begin = 0
    for row, count in enumerate(num_blocks_each):
        tables[row, :count] = pool[begin:begin + count]
        begin += count
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
    old_plan, new_plan = padded_plan(tables, seq_lens, BLOCK_SIZE), torch_paged.plan_decode(tables, seq_lens, BLOCK_SIZE)
    runs = {"old": lambda: padded_attention(query, key_cache, value_cache, old_plan, 0.125),
            "new": lambda: torch_paged.decode_attention_planned(query, key_cache, value_cache, new_plan, 0.125)}
    torch.testing.assert_close(runs["new"](), runs["old"]())
    samples = {"old": [], "new": []}
    for round_index in range(repeats * calls):  # call by call, so both see the same neighbours
        for name in alternate(("old", "new"), round_index):
            start = time.perf_counter()
            runs[name]()
            samples[name].append(time.perf_counter() - start)
    return median_ms(samples["old"]), median_ms(samples["new"])


def alternate(pair: tuple, round_index: int) -> tuple:
    """A B, then B A: neither version always runs first (ABBA)."""
    return pair if round_index % 2 == 0 else pair[::-1]


class StepBench:
    """The demo model's engine with one batch in decode; steps timed with the padded or grouped plan."""

    def __init__(self, model: str) -> None:
        from pdserve import LLM

        self.llm = LLM(model, dtype="float32", max_num_seqs=64, max_num_batched_tokens=4096,
                       enable_prefix_caching=False, num_kv_blocks=2048)
        self.engine = self.llm.engine
        self.backend = self.engine.runner.attn_backend
        self.count = 0

    def use_padded(self, padded: bool) -> None:
        for name in ("prepare", "forward_decode"):
            self.backend.__dict__.pop(name, None)  # back to the class's (grouped) methods
        if padded:
            def padded_prepare(context):  # the backend's prepare with the former decode plan (decode steps)
                if context.num_tokens != context.num_decode_tokens:
                    raise RuntimeError("the padded plan is timed on decode-only steps")
                decode = padded_plan(context.decode_block_tables, context.decode_seq_lens, BLOCK_SIZE)
                return TorchPagedMetadata(torch_paged.plan_store(context.slot_mapping), decode, None)

            self.backend.prepare = padded_prepare
            self.backend.forward_decode = lambda query, layer, metadata: padded_attention(
                query, layer.key_cache, layer.value_cache, metadata.decode, layer.scale)

    def start(self, lens: list[int], max_tokens: int) -> None:
        from pdserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for length in lens:
            self.count += 1
            ids = [10 + (self.count * 7919 + i) % 40000 for i in range(length - 1)]  # + 1 new token = length
            self.engine.add_request(self.engine.make_request(f"r{self.count}", ids, params))
        while any(s.num_new_tokens > 1 for s in self.step()):
            pass  # prompts computed; every later step decodes the whole batch

    def step(self):
        plan = self.engine.scheduler.schedule()
        sampled = self.engine.runner.execute(plan, self.engine.kv_transfer.layer_hook(plan)).sampled
        self.engine.scheduler.update_from_output(plan, sampled)
        return plan.scheduled

    def case(self, lens: list[int], repeats: int) -> tuple[float, float]:
        """(padded ms, grouped ms) per decode step, medians of alternating steps."""
        self.start(lens, 4 * repeats + 4)
        samples = {True: [], False: []}
        for round_index in range(2 * repeats):
            for padded in alternate((True, False), round_index):
                self.use_padded(padded)
                start = time.perf_counter()
                scheduled = self.step()
                samples[padded].append(time.perf_counter() - start)
                if len(scheduled) != len(lens):
                    raise RuntimeError(f"a decode step ran {len(scheduled)} requests, not {len(lens)}")
        self.use_padded(False)
        while self.engine.has_work():
            self.step()
        return median_ms(samples[True]), median_ms(samples[False])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the llama-small-v2 demo model)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default: 8, 20, 32)")
    parser.add_argument("--repeats", type=int, default=15, help="alternating rounds per case")
    parser.add_argument("--calls", type=int, default=20, help="per-layer calls per round (x repeats)")
    parser.add_argument("--no-step", action="store_true", help="per-layer attention only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batches = args.batch or [8, 20, 32]
    print("per layer (attention only)        padded ms  grouped ms  ratio")
    for batch in batches:
        for label, (low, high) in SPREADS.items():
            old, new = layer_case(batch, context_lens(batch, low, high), args.repeats, args.calls)
            print(f"  batch {batch:3d} {label:16s}    {old:8.3f}  {new:10.3f}  {new / old:5.2f}")
    if args.no_step:
        return 0
    from pdserve.demo_model import default_demo_model

    bench = StepBench(args.model or str(default_demo_model("llama", "small")))
    print(f"whole decode step ({bench.llm.model_config.num_layers} layers)    padded ms  grouped ms  ratio")
    for batch in batches:
        for label, (low, high) in SPREADS.items():
            old, new = bench.case(context_lens(batch, low, high), args.repeats)
            print(f"  batch {batch:3d} {label:16s}    {old:8.2f}  {new:10.2f}  {new / old:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
