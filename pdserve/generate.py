"""`pdserve generate`: offline, colocated generation on one engine; prints each completion and tokens/s."""

from __future__ import annotations

import argparse
import time

DEMO_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Prefill and decode run on different GPUs because",
    "import torch\n",
    "Once upon a time",
    "The KV cache holds",
    "class Scheduler:",
    "In a distributed system,",
]


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    return [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_prompts)]


def run_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, seed=args.seed, enforce_eager=args.enforce_eager,
        model_impl=args.model_impl,
    )
    loaded = time.perf_counter()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompts = _prompts(args)
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - loaded
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for output in outputs:
        completion = output.outputs[0]
        print(f"--- {output.prompt!r} -> [{len(completion.token_ids)} tokens, {completion.finish_reason}]")
        print(completion.text)
    config = llm.model_config
    print(
        f"\n{config.architecture} from {config.model_dir} ({config.dtype}, {args.device}); loaded in "
        f"{loaded - started:.1f}s\n{len(prompts)} prompts, {num_generated} tokens in {elapsed:.2f}s: "
        f"{num_generated / elapsed:.1f} tokens/s"
    )
    return 0
