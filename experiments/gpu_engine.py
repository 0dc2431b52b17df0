"""The whole engine on a GPU: greedy parity with transformers, and offline throughput with and
without decode CUDA graphs.

    python experiments/gpu_engine.py                         # parity (tiny model, fp32) + throughput
    python experiments/gpu_engine.py --batch 1 --batch 64    # chosen batch sizes only
    python experiments/gpu_engine.py --skip-parity --model DIR --dtype bfloat16

Parity: a tiny random-weight Llama, fp32, greedy on cuda (with graphs, then eager) against
transformers' generate() on the same weights on CPU; token for token, except that after a near tie
(top-2 logits within 1e-3 in transformers) the continuations may legitimately differ.
Throughput: the SmolLM-135M-shaped demo model (or --model) in bf16; each batch size runs `batch`
prompts of --prompt-len random tokens for --new-tokens greedy tokens each, on one engine with CUDA
graphs and one with enforce_eager. Reported: generated tokens per second over the whole generate()
call, and that time divided by --new-tokens (ms per step, the prefill's share included).
Exit status: 1 if parity fails, else 0 (also without CUDA, after saying so).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time

import torch

TIE_GAP = 1e-3
BLOCK_SIZE = 16


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- parity


def _transformers_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def _first_real_mismatch(ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> str | None:
    """None when equal (or equal up to a near tie); else a description of the first difference."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top2 = torch.topk(logits[step].float(), 2).values
            gap = float(top2[0] - top2[1])
            return None if gap < TIE_GAP else f"step {step}: pdserve {a}, transformers {b} (top-2 gap {gap:.2e})"
    return None if len(ours) == len(theirs) else f"{len(ours)} tokens vs transformers' {len(theirs)}"


def check_parity(new_tokens: int = 16) -> bool:
    from transformers import AutoModelForCausalLM

    from pdserve import LLM, SamplingParams
    from pdserve.demo_model import make_demo_model

    model_dir = str(make_demo_model(tempfile.mkdtemp(prefix="pdserve-parity-"), arch="llama", size="tiny"))
    # 7 prompts (a padded batch of 8), 1 to 47 tokens: one block, block boundaries, several blocks.
    prompts = random_prompts(2, 1, 1024, seed=1) + [p[: 3 + 11 * i] for i, p in
                                                    enumerate(random_prompts(5, 60, 1024, seed=2))]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [_transformers_greedy(reference, p, new_tokens) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ok = True
    for label, eager in (("cuda graphs", False), ("eager", True)):
        llm = LLM(model_dir, dtype="float32", device="cuda", block_size=BLOCK_SIZE, num_kv_blocks=256,
                  enforce_eager=eager)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        graphs = llm.engine.runner.decode_graphs
        replays = sum(graphs.replays.values()) if graphs is not None else 0
        failures = [f"prompt {i}: {why}" for i, (out, (theirs, logits)) in enumerate(zip(outputs, expected))
                    if (why := _first_real_mismatch(out.outputs[0].token_ids, theirs, logits))]
        leaked = llm.kv_cache_manager.num_used_blocks
        passed = not failures and leaked == 0 and (eager or replays > 0)
        print(f"parity vs transformers ({label}, fp32, {len(prompts)} prompts x {new_tokens} tokens, "
              f"{replays} graph replays): {'OK' if passed else 'MISMATCH'}")
        for failure in failures:
            print(f"  {failure}")
        if leaked:
            print(f"  {leaked} KV blocks still in use after generation")
        if not eager and replays == 0:
            print("  no decode step ran through a CUDA graph")
        ok = ok and passed
        del llm
        _free_cuda()
    return ok


# ---------------------------------------------------------------------------- throughput


def _engine(model: str, dtype: str, enforce_eager: bool, max_batch: int, context: int):
    from pdserve import LLM

    num_blocks = max_batch * (-(-context // BLOCK_SIZE) + 1) + 64
    started = time.perf_counter()
    llm = LLM(model, dtype=dtype, device="cuda", block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
              max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * context),
              enable_prefix_caching=False, enforce_eager=enforce_eager)
    return llm, time.perf_counter() - started


def _time_generate(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    return elapsed


def measure(model: str, dtype: str, batches: list[int], prompt_len: int, new_tokens: int) -> dict:
    """{(mode, batch): seconds for one generate() of `batch` prompts}, one engine per mode."""
    from pdserve.engine.config import ModelConfig

    vocab_size = ModelConfig.from_hf(model).vocab_size
    results = {}
    for mode, eager in (("eager", True), ("graphs", False)):
        llm, load_s = _engine(model, dtype, eager, max(batches), prompt_len + new_tokens)
        graphs = llm.engine.runner.decode_graphs
        if graphs is not None:
            print(f"{mode}: engine ready in {load_s:.1f} s, {len(graphs.graphs)} graphs captured "
                  f"(batch sizes {graphs.batch_sizes[0]}..{graphs.batch_sizes[-1]}, table widths "
                  f"{graphs.table_widths} blocks)")
        else:
            print(f"{mode}: engine ready in {load_s:.1f} s")
        for batch in batches:
            prompts = random_prompts(batch, prompt_len, vocab_size, seed=batch)
            _time_generate(llm, prompts[:1], 4)  # warm-up: Triton compiles the prefill kernels
            results[(mode, batch)] = _time_generate(llm, prompts, new_tokens)
        del llm
        _free_cuda()
    return results


def format_results(results: dict, batches: list[int], new_tokens: int) -> str:
    header = (f"{'batch':>5} {'eager tok/s':>12} {'graphs tok/s':>13} {'eager ms/step':>14} "
              f"{'graphs ms/step':>15} {'speedup':>8}")
    lines = [header]
    for batch in batches:
        eager, graphs = results[("eager", batch)], results[("graphs", batch)]
        tokens = batch * new_tokens
        lines.append(f"{batch:>5} {tokens / eager:>12.1f} {tokens / graphs:>13.1f} {1e3 * eager / new_tokens:>14.2f} "
                     f"{1e3 * graphs / new_tokens:>15.2f} {eager / graphs:>7.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the SmolLM-135M-shaped demo model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default: 1, 32, 64)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark. Run `python experiments/gpu_engine.py` on a GPU machine; on CPU, "
              "tests/engine/test_cuda_graphs.py checks the graph runner's padding and buffers without graphs.")
        return 0
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}")
    ok = True
    if not args.skip_parity:
        ok = check_parity()
    if not args.skip_throughput:
        if args.model is None:
            from pdserve.demo_model import default_demo_model

            args.model = str(default_demo_model("llama", "small"))
        batches = args.batch or [1, 32, 64]
        print(f"\nthroughput: {args.model}, {args.dtype}, prompts of {args.prompt_len} tokens, "
              f"{args.new_tokens} new tokens each, block size {BLOCK_SIZE}")
        results = measure(args.model, args.dtype, batches, args.prompt_len, args.new_tokens)
        print(format_results(results, batches, args.new_tokens))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
