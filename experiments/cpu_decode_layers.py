"""A CPU bf16 decode step through every layer in one native call (engine/models/cpu_decode_layers.py) against the
same layers called one by one from Python, in turns in one process: the median decode step (a generate of
--new-tokens less one of a single token, over the steps between) and the whole generate's output tokens/s.

    python experiments/cpu_decode_layers.py [--model DIR] [--threads 2] [--batch 8] [--num-prompts 16]
                                            [--prompt-len 256] [--new-tokens 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the SmolLM-135M-shaped demo model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together (max_num_seqs)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)

    from pdserve import LLM, SamplingParams
    from pdserve.demo_model import default_demo_model

    torch.set_num_threads(args.threads)
    llm = LLM(args.model or str(default_demo_model()), dtype="bfloat16", num_kv_blocks=4096, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.prompt_len), enable_prefix_caching=False)
    stack = llm.engine.runner.model.model
    one_call = stack.native_decode
    if one_call is None:
        raise SystemExit("this model and host run decode steps layer by layer (see the engine's start-up log)")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(args.prompt_len)]}
               for _ in range(args.num_prompts)]

    def seconds(prompts, tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started

    seconds(prompts[:2], 4)  # warm-up
    ways = {"one call": one_call, "layer by layer": None}
    steps: dict[str, list[float]] = {name: [] for name in ways}
    rates: dict[str, list[float]] = {name: [] for name in ways}
    batch = prompts[:args.batch]
    for _ in range(args.rounds):
        for name, step in ways.items():
            stack.native_decode = step
            steps[name].append((seconds(batch, args.new_tokens) - seconds(batch, 1)) / (args.new_tokens - 1) * 1e3)
            rates[name].append(args.num_prompts * args.new_tokens / seconds(prompts, args.new_tokens))
    stack.native_decode = one_call
    print(f"{args.threads} thread(s), batch {args.batch}, {args.prompt_len} in / {args.new_tokens} out, "
          f"{args.num_prompts} prompts, {args.rounds} rounds in turns")
    for name in ways:
        print(f"  {name:15} decode step ms {' / '.join(f'{ms:.2f}' for ms in steps[name])} "
              f"(median {statistics.median(steps[name]):.2f}); tok/s {' / '.join(f'{r:.1f}' for r in rates[name])}")
    step_ratio = statistics.median(b / a for a, b in zip(steps["one call"], steps["layer by layer"]))
    rate_ratio = statistics.median(a / b for a, b in zip(rates["one call"], rates["layer by layer"]))
    print(f"  one call against layer by layer: decode step {step_ratio:.2f}x as fast, tok/s {rate_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
