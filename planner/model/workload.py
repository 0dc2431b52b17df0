"""The requests a plan simulates: `pdserve bench`'s datasets (lengths only) at its arrival times, with
the same seeds, so a simulated load is the load bench would send."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from pdserve.bench.serve_arrivals import arrival_offsets
from pdserve.bench.serve_datasets import DatasetError, draw_lengths


@dataclass(frozen=True)
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if not self.prompt_lens:
            raise DatasetError("the dataset has no requests: give --num-prompts >= 1, or a dataset file with requests")

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def arrivals(self, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
        return arrival_offsets(len(self), request_rate, burstiness, seed).tolist()


def random_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> Workload:
    """The lengths bench's random dataset draws for these flags (its generator, in its order)."""
    rng = np.random.default_rng(seed)
    inputs = draw_lengths(rng, num_prompts, input_len, range_ratio, "--input-len")
    outputs = draw_lengths(rng, num_prompts, output_len, range_ratio, "--output-len")
    return Workload(inputs, outputs)


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.num_prompts < 1:
        raise DatasetError(f"--num-prompts {args.num_prompts}: the dataset has no requests; give at least 1")
    if args.dataset == "random":
        return random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    if args.dataset in ("sharegpt", "jsonl") and not args.dataset_path:
        raise ValueError(f"--dataset {args.dataset} reads a file: pass --dataset-path FILE")
    from pdserve.bench.serve_run import make_samples
    from pdserve.demo_model import default_demo_model
    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model or str(default_demo_model()))
    samples = make_samples(args, tokenizer, args.num_prompts)
    return Workload([s.prompt_len for s in samples], [s.output_len for s in samples])
