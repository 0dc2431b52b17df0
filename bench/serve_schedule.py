"""What a `pdserve bench` run sends, and when: the warmup prompts (at once, not measured), then each
measured prompt at its arrival offset, and for phased and trace runs the phase window each arrived in."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.bench.serve_datasets import SampleRequest
from pdserve.bench.serve_phases import (
    PhaseWindow,
    check_nonempty,
    parse_phases,
    phase_windows,
    phased_samples,
    warmup_samples,
    window_arrivals,
)
from pdserve.bench.serve_trace import read_trace, trace_samples, trace_windows

@dataclass(frozen=True)
class Schedule:
    samples: list[SampleRequest]  # the measured requests, in order of arrival
    offsets: list[float]  # [len(samples)] seconds after the start of the measured load
    warmup: list[SampleRequest] = field(default_factory=list)
    windows: list[PhaseWindow] = field(default_factory=list)  # phases in order; empty when the run has none
    owners: list[int] | None = None  # [len(samples)] the index of the window each request arrived in

    def first_n(self, count: int) -> Schedule:
        """The first `count` measured requests, and the windows they arrived in."""
        owners = self.owners[:count] if self.owners is not None else None
        windows = self.windows[:owners[-1] + 1] if owners else self.windows
        return Schedule(self.samples[:count], self.offsets[:count], self.warmup, windows, owners)


def phased_schedule(args: argparse.Namespace, tokenizer) -> Schedule:
    phases = parse_phases(args.phases)
    windows = phase_windows(phases, args.phase_cycles)
    offsets, owners = window_arrivals(windows, args.burstiness, args.seed)
    check_nonempty(owners)
    samples = phased_samples(tokenizer, windows, owners, args.seed)
    return Schedule(samples, offsets.tolist(), warmup_samples(tokenizer, phases[0], args.warmup, args.seed),
                    windows, owners.tolist())


def trace_schedule(args: argparse.Namespace, tokenizer) -> Schedule:
    """The trace's lines at their offsets; the warmup reuses its first prompts (the trace itself is all measured)."""
    lines = read_trace(args.dataset_path, args.output_len)
    samples = trace_samples(lines, tokenizer, args.seed, args.dataset_path)
    windows, owners = trace_windows(lines)
    warmup = [samples[i % len(samples)] for i in range(args.warmup)]
    return Schedule(samples, [line.arrival_s for line in lines], warmup, windows, owners)
