"""Where the engine's time goes: torch profiler over one offline generate call (a batch of prompts
prefilled, then decoded greedily), the ops sorted by their own CPU time.

    OMP_NUM_THREADS=1 taskset -c 0 python experiments/profile_engine.py --model DIR \\
        --num-prompts 8 --prompt-len 256 --max-tokens 64
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=14, help="ops to list")
    args = parser.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", num_kv_blocks=4096)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + args.prompt_len))} for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: first-step allocations and thread start
    start = time.perf_counter()
    llm.generate(prompts, params)
    print(f"generate: {time.perf_counter() - start:.2f} s for {args.num_prompts} x {args.prompt_len} prompt tokens "
          f"and {args.num_prompts} x {args.max_tokens} output tokens")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
