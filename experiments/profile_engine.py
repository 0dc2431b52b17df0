"""Where the engine's time goes: torch profiler over one offline generate call (a batch of prompts
prefilled, then decoded greedily), the ops sorted by their own CPU time. With --parts, instead, the
engine's parts (scheduler, prepare, linears, attention, norms, rotary, sampler, ...) timed in this
thread's CPU seconds, which a busy host inflates less than wall time; run it on one thread.

    OMP_NUM_THREADS=1 taskset -c 0 python experiments/profile_engine.py --model DIR \\
        --num-prompts 8 --prompt-len 256 --max-tokens 64 [--dtype bfloat16] [--parts]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import time
from collections.abc import Iterator

# (module, attribute, part): what --parts times; nested parts are inside "forward + logits"
PARTS = [
    ("pdserve.engine.engine_core", "EngineCore.step", "engine step"),
    ("pdserve.engine.scheduler", "Scheduler.schedule", "schedule"),
    ("pdserve.engine.scheduler", "Scheduler.update_from_output", "update from output"),
    ("pdserve.engine.model_runner", "ModelRunner.prepare", "prepare (step tensors)"),
    ("pdserve.engine.model_runner", "ModelRunner.step_logits", "forward + logits"),
    ("pdserve.engine.layers.linear", "_packed_linear", "linears (lm_head too)"),
    ("pdserve.engine.models.llama", "LlamaForCausalLM.compute_logits", "lm_head"),
    ("pdserve.kernels.torch_paged", "decode_attention_planned", "decode attention"),
    ("pdserve.kernels.cpu_native", "paged_decode", "decode attention"),  # the native kernel, where it runs
    ("pdserve.kernels.torch_paged", "prefill_attention_planned", "prefill attention"),
    ("pdserve.kernels.cpu_prefill", "paged_prefill", "prefill attention"),  # the native bf16 kernel, where it runs
    ("pdserve.kernels.torch_paged", "store_kv_planned", "KV store"),
    ("pdserve.kernels.torch_paged", "plan_decode", "decode plan"),
    ("pdserve.engine.models.cpu_decode_layers", "NativeDecodeStep.__call__", "decode layers in one native call"),
    ("pdserve.engine.layers.norm", "RMSNorm.forward", "norms"),
    ("pdserve.engine.layers.rotary", "TableRotation.__call__", "rotary"),
    ("pdserve.engine.layers.sampler", "Sampler.__call__", "sampler"),
]


@contextlib.contextmanager
def timed_parts() -> Iterator[collections.Counter]:
    """While open, each of PARTS adds its thread CPU seconds to the yielded counter; restored on exit."""
    spent: collections.Counter = collections.Counter()
    originals = []
    for module_name, attribute, part in PARTS:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for step in path:
            owner = getattr(owner, step)
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, _timed(getattr(owner, name), part, spent))
    try:
        yield spent
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def _timed(fn, part: str, spent: collections.Counter):
    def timed(*args, **kwargs):
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.thread_time() - started
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=14, help="ops to list")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--parts", action="store_true", help="the engine's parts instead of the op table")
    args = parser.parse_args(argv)
    with timed_parts() if args.parts else contextlib.nullcontext() as spent:
        return _profile(args, spent)


def _profile(args: argparse.Namespace, spent: collections.Counter | None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=4096, max_num_seqs=max(args.num_prompts, 1),
              max_num_batched_tokens=max(2048, args.prompt_len * args.num_prompts), enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + args.prompt_len))} for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: first-step allocations and thread start
    if spent is not None:
        spent.clear()
    start, cpu_start = time.perf_counter(), time.thread_time()
    llm.generate(prompts, params)
    cpu = time.thread_time() - cpu_start
    print(f"generate: {time.perf_counter() - start:.2f} s ({cpu:.2f} s of this thread's CPU) for {args.num_prompts} x "
          f"{args.prompt_len} prompt tokens and {args.num_prompts} x {args.max_tokens} output tokens")
    if spent is not None:
        for part, seconds in spent.most_common():
            print(f"  {part:<24} {seconds:7.3f} s {100 * seconds / cpu:5.1f}%")
        return 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    _name_unseen_kernels(llm)
    return 0


def _name_unseen_kernels(llm) -> None:
    """Say so when linears run on pdserve's C kernels (ctypes calls, which torch's profiler does not list)."""
    from pdserve.engine.layers.linear import Linear

    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    native = sum(linear.native_weight is not None for linear in linears)
    if native:
        print(f"{native} of {len(linears)} linears run on pdserve's C kernels, which this table does not list: "
              "--parts times them")


if __name__ == "__main__":
    raise SystemExit(main())
