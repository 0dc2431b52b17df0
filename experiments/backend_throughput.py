"""Offline throughput of pdserve's native model code against the transformers backend, same model.

    python experiments/backend_throughput.py [--model DIR] [--batch 1 --batch 32] [--prompt-len 128]
                                       [--new-tokens 64] [--repeats 1] [--threads N] [--profile]

Both run in this one process on the same random prompts (greedy, fp32, ignore_eos, no prefix
caching), through the same engine: scheduler, paged KV cache, sampler; only the model code differs
(engine.models.llama vs transformers' modeling code with pdserve's attention). The two runs of each
batch size alternate `--repeats` times and the best of each is kept, so load from other processes
on a shared machine hurts both alike. `--profile` prints, per implementation, the top torch ops of
one timed run (torch.profiler), to show where the difference comes from. On a machine shared with
other busy processes, --threads 1 gives steadier figures: with more torch threads than free cores,
every op pays for a thread barrier, which punishes the implementation that runs more, smaller ops.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

IMPLS = ("native", "transformers")


def make_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(num)]


def build_llm(model_dir: str, impl: str, batch: int, prompt_len: int):
    from pdserve import LLM

    return LLM(model_dir, dtype="float32", model_impl=impl, max_num_seqs=batch,
               max_num_batched_tokens=max(2048, prompt_len * batch), enable_prefix_caching=False)


def timed_generate(llm, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens per second of one generate() over all prompts."""
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - started
    if any(len(o.outputs[0].token_ids) != new_tokens for o in outputs):
        raise RuntimeError("a request stopped early although ignore_eos is set")
    return len(prompts) * new_tokens / elapsed


def warm_up(llm) -> None:
    from pdserve import SamplingParams

    llm.generate({"prompt_token_ids": [11, 12, 13]}, SamplingParams(temperature=0, max_tokens=2))


def profile(llm, prompts: list[list[int]], new_tokens: int, label: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_generate(llm, prompts, new_tokens)
    print(f"\n--- {label}: top ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def run_batch(model_dir: str, prompts: list[list[int]], batch: int, args) -> dict[str, float]:
    llms = {impl: build_llm(model_dir, impl, batch, args.prompt_len) for impl in IMPLS}
    for llm in llms.values():
        warm_up(llm)
    best = {impl: 0.0 for impl in IMPLS}
    for _ in range(args.repeats):
        for impl in IMPLS:
            best[impl] = max(best[impl], timed_generate(llms[impl], prompts, args.new_tokens))
    if args.profile:
        for impl in IMPLS:
            profile(llms[impl], prompts, args.new_tokens, f"{impl}, batch {batch}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the SmolLM-135M-shaped demo Llama)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default: 1 and 32)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="alternating timed runs per batch; best kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true", help="print the top torch ops of each implementation")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from pdserve.demo_model import default_demo_model

        args.model = str(default_demo_model("llama", "small"))
    from pdserve.engine.config import ModelConfig

    vocab_size = ModelConfig.from_hf(args.model).vocab_size
    print(f"model {args.model}; torch threads {torch.get_num_threads()}; "
          f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, fp32")
    print(f"{'batch':>5} {'native tok/s':>13} {'transformers tok/s':>19} {'backend/native':>15}")
    for batch in args.batch or [1, 32]:
        prompts = make_prompts(batch, args.prompt_len, vocab_size)
        best = run_batch(args.model, prompts, batch, args)
        native, backend = best["native"], best["transformers"]
        print(f"{batch:>5} {native:>13.1f} {backend:>19.1f} {backend / native:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
