"""Offline generation throughput: pdserve's engine against transformers' generate() on the same model.

    python experiments/offline_throughput.py [--model DIR] [--batch 32 --batch 1] [--prompt-len 128] [--new-tokens 64]
                                       [--dtype float32|bfloat16]

Both run greedy, in the same dtype (fp32 unless --dtype says otherwise), on the same random prompts in this one process, so the ratio is meaningful on
a shared, noisy machine. transformers runs each batch as one padded generate() call; pdserve gets all
prompts at once and batches them itself (max_num_seqs = batch size).
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def make_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(num)]


def run_transformers(model_dir: str, prompts: list[list[int]], batch: int, new_tokens: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False)  # warm-up
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = torch.tensor(prompts[i:i + batch])  # equal lengths: no padding needed
        model.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return len(prompts) * new_tokens / (time.perf_counter() - started)


def run_pdserve(model_dir: str, prompts: list[list[int]], batch: int, new_tokens: int, dtype: str) -> float:
    from pdserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=max(2048, 128 * batch),
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=2))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the SmolLM-135M-shaped demo model)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default: 32 and 1)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: max(batch, 4)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines")
    args = parser.parse_args()
    if args.model is None:
        from pdserve.demo_model import default_demo_model

        args.model = str(default_demo_model("llama", "small"))
    from pdserve.engine.config import ModelConfig

    vocab_size = ModelConfig.from_hf(args.model).vocab_size
    print(f"model {args.model}; {args.dtype}; torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'prompts':>7} {'transformers tok/s':>19} {'pdserve tok/s':>14} {'ratio':>6}")
    for batch in args.batch or [32, 1]:
        num_prompts = args.num_prompts or max(batch, 4)
        prompts = make_prompts(num_prompts, args.prompt_len, vocab_size)
        theirs = run_transformers(args.model, prompts, batch, args.new_tokens, args.dtype)
        ours = run_pdserve(args.model, prompts, batch, args.new_tokens, args.dtype)
        print(f"{batch:>5} {num_prompts:>7} {theirs:>19.1f} {ours:>14.1f} {ours / theirs:>6.2f}")


if __name__ == "__main__":
    main()
