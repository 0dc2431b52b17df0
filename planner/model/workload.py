"""The requests a plan simulates: `pdserve bench`'s datasets (lengths only) at its arrival times, with
the same seeds, so a simulated load is the load bench would send; and bench's phased dataset (a workload that shifts),
its phases' rates scaled together to the rate simulated."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from pdserve.bench.serve_arrivals import arrival_offsets
from pdserve.bench.serve_datasets import DatasetError, draw_lengths
from pdserve.bench.serve_phases import Phase, parse_phases, phase_windows, window_arrivals


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

    def at_rate(self, request_rate: float, burstiness: float = 1.0, seed: int = 0
                ) -> tuple[list[float], list[int], list[int]]:
        """(arrival offsets, prompt lengths, output lengths) of the run at this rate."""
        return self.arrivals(request_rate, burstiness, seed), self.prompt_lens, self.output_lens

    def describe(self) -> str:
        return f"{len(self)} requests"


@dataclass(frozen=True)
class PhasedWorkload(Workload):
    """bench's phased dataset: the phases in order, `cycles` times. Simulated at a rate R, every phase's rate is
    scaled by the same factor so that the whole run's mean is R (the phases' durations stay): the phases' own rates
    give the mix, the search the load. prompt_lens and output_lens: the run at the phases' own rates."""
    phases: tuple[Phase, ...] = ()
    cycles: int = 1

    @classmethod
    def of(cls, phases: list[Phase], cycles: int, seed: int = 0) -> PhasedWorkload:
        phase_windows(phases, cycles)  # checks the cycles and the span
        _, prompts, outputs = _phased_run(phases, cycles, 1.0, 1.0, seed)
        if not prompts:
            raise DatasetError("--phases: no request arrives in any phase: raise the rates or the durations")
        return cls(prompts, outputs, tuple(phases), cycles)

    @property
    def mean_rate(self) -> float:
        """Requests per second over the whole run at the phases' own rates."""
        return _mean_rate(self.phases)

    def at_rate(self, request_rate: float, burstiness: float = 1.0, seed: int = 0
                ) -> tuple[list[float], list[int], list[int]]:
        return _phased_run(self.phases, self.cycles, request_rate / self.mean_rate, burstiness, seed)

    def describe(self) -> str:
        spec = ",".join(phase.label() for phase in self.phases)
        return f"phases {spec} x {self.cycles} (rates scaled together: {len(self)} requests at their own rates)"


def _mean_rate(phases: tuple[Phase, ...] | list[Phase]) -> float:
    return sum(p.request_rate * p.duration_s for p in phases) / sum(p.duration_s for p in phases)


def _phased_run(phases, cycles: int, scale: float, burstiness: float, seed: int
                ) -> tuple[list[float], list[int], list[int]]:
    """The phased run with every phase's rate times `scale`: bench's arrival stream, and each request's lengths
    drawn from its phase's (a generator of their own: bench draws them between its prompts' tokens)."""
    scaled = [Phase(p.input_len, p.output_len, p.request_rate * scale, p.duration_s, p.range_ratio) for p in phases]
    windows = phase_windows(scaled, cycles)
    offsets, owners = window_arrivals(windows, burstiness, seed)
    rng = np.random.default_rng([seed, 3])
    prompts, outputs = np.zeros(owners.size, dtype=np.int64), np.zeros(owners.size, dtype=np.int64)
    for index, window in enumerate(windows):
        slots = np.flatnonzero(owners == index)
        spec = window.spec
        prompts[slots] = draw_lengths(rng, slots.size, spec.input_len, spec.range_ratio, "--phases input_len")
        outputs[slots] = draw_lengths(rng, slots.size, spec.output_len, spec.range_ratio, "--phases output_len")
    return offsets.tolist(), prompts.tolist(), outputs.tolist()


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
    if args.dataset == "phased":
        if not args.phases:
            raise ValueError("--dataset phased needs --phases IN:OUT:RATE:SECONDS[:RATIO],... (or a JSON file of "
                             "them), as `pdserve bench` takes them")
        return PhasedWorkload.of(parse_phases(args.phases), args.phase_cycles, args.seed)
    if args.phases:
        raise ValueError("--phases goes with --dataset phased: add it, or leave --phases out")
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
