"""What two API features cost the engine, against the same work without them, in one process, runs
alternating, medians, ratios to the plain run:

    python experiments/feature_cost.py [--model DIR] [--repeats 5] [--only prompt_logprobs|structured_output]

prompt_logprobs: prompts through the offline engine without them, with prompt_logprobs=0 and with
prompt_logprobs=5, one generated token each (lm-eval's loglikelihood request), so the time is the
prefill's. The prefix cache is off: a request with prompt logprobs never takes a hit, so all three
compute the same prompts.

structured_output: a batch decoding a fixed number of tokens, unconstrained against constrained by a
regex that never completes ([a-z ]*, so every request runs to max_tokens): the cost of filling and
applying each row's mask every step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve import LLM, SamplingParams, StructuredOutputsParams
from pdserve.demo_model import default_demo_model


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the built-in demo model)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["prompt_logprobs", "structured_output"], default=None)
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompt_logprobs: tokens per prompt")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompt_logprobs: prompts per run")
    parser.add_argument("--batch", type=int, default=8, help="structured_output: requests per run")
    parser.add_argument("--max-tokens", type=int, default=64, help="structured_output: tokens per request")
    return parser.parse_args(argv)


def alternate(llm: LLM, prompts: list, variants: dict[str, SamplingParams], repeats: int) -> dict[str, float]:
    """Median seconds of llm.generate(prompts, params) per variant; the first round warms up."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats + 1):
        for name, params in variants.items():
            started = time.perf_counter()
            llm.generate(prompts, params)
            if repeat:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(samples) for name, samples in times.items()}


def report(title: str, medians: dict[str, float]) -> None:
    print(title)
    base = next(iter(medians.values()))
    for name, median in medians.items():
        print(f"  {name:22s} median {median * 1000:9.1f} ms  ratio {median / base:.3f}")


def prompt_logprobs_cost(llm: LLM, args) -> None:
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}
               for _ in range(args.num_prompts)]
    variants = {f"prompt_logprobs={k}": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
                for k in (None, 0, 5)}
    report(f"prompt logprobs: {args.num_prompts} prompts of {args.prompt_len} tokens, vocabulary {vocab}, "
           f"{args.repeats} runs each", alternate(llm, prompts, variants, args.repeats))


def structured_output_cost(llm: LLM, args) -> None:
    prompts = [f"Request {i} says" for i in range(args.batch)]
    common = {"temperature": 1.0, "seed": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
    variants = {"unconstrained": SamplingParams(**common),
                "regex [a-z ]*": SamplingParams(**common, structured_outputs=StructuredOutputsParams(regex="[a-z ]*"))}
    report(f"structured output: {args.batch} requests x {args.max_tokens} tokens, {args.repeats} runs each",
           alternate(llm, prompts, variants, args.repeats))


def main(argv=None) -> None:
    args = parse_args(argv)
    llm = LLM(args.model or str(default_demo_model()), dtype="float32", enable_prefix_caching=False)
    if args.only in (None, "prompt_logprobs"):
        prompt_logprobs_cost(llm, args)
    if args.only in (None, "structured_output"):
        structured_output_cost(llm, args)


if __name__ == "__main__":
    main()
