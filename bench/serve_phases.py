"""The phased dataset of `pdserve bench`: a workload that shifts. A sequence of phases, each
(input length, output length, request rate, duration, optional range ratio), run in order one or more
cycles; requests arrive within each phase's window as a Poisson process at its rate (gamma gaps with
--burstiness), and each is a random-token prompt drawn with that phase's lengths, all from --seed.

`--phases 1000:48:0.3:60,128:256:1.0:60` or `--phases phases.json` (a JSON list of
{"input_len", "output_len", "request_rate", "duration_s", "range_ratio"} objects).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.serve_arrivals import MAX_ARRIVAL_SPAN_S, check_arrival_args
from pdserve.bench.serve_datasets import DatasetError, SampleRequest, draw_lengths, plain_token_ids, random_prompts

SPEC_HELP = ("write IN:OUT:RATE:SECONDS[:RANGE_RATIO] per phase, comma-separated, e.g. --phases "
             "1000:48:0.3:60,128:256:1.0:60, or give a JSON file of "
             '[{"input_len": 1000, "output_len": 48, "request_rate": 0.3, "duration_s": 60}, ...]')
FIELDS = ("input_len", "output_len", "request_rate", "duration_s", "range_ratio")


@dataclass(frozen=True)
class Phase:
    input_len: int  # prompt tokens (around it with range_ratio)
    output_len: int  # max_tokens (around it with range_ratio)
    request_rate: float  # requests per second, mean of the phase's arrivals
    duration_s: float  # how long the phase's arrivals last
    range_ratio: float = 0.0

    def label(self) -> str:
        ratio = f":{self.range_ratio:g}" if self.range_ratio else ""
        return f"{self.input_len}:{self.output_len}:{self.request_rate:g}:{self.duration_s:g}{ratio}"


@dataclass(frozen=True)
class PhaseWindow:
    """One phase's stretch of the run: requests that arrive in [start_s, end_s) belong to it."""

    phase: int | str  # 1-based place among the phases (a trace's label may be a name)
    cycle: int  # 1-based cycle; 0 in a trace without cycles
    start_s: float
    end_s: float
    spec: Phase | None = None  # None for a trace's window

    @property
    def name(self) -> str:
        return f"phase {self.phase}" + (f" cycle {self.cycle}" if self.cycle else "")


def _phase_of(values: dict, where: str) -> Phase:
    """A Phase from its fields, each checked; `where` names the phase in errors."""
    ints = {"input_len": values.get("input_len"), "output_len": values.get("output_len")}
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} {value!r} must be a whole number of tokens, at least 1: {SPEC_HELP}")
    numbers = {name: values.get(name, 0.0 if name == "range_ratio" else None)
               for name in ("request_rate", "duration_s", "range_ratio")}
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}: {name} {value!r} must be a finite number: {SPEC_HELP}")
    if not numbers["request_rate"] > 0:
        raise ValueError(f"{where}: request_rate {numbers['request_rate']:g} must be above 0 requests per second")
    if not numbers["duration_s"] > 0:
        raise ValueError(f"{where}: duration_s {numbers['duration_s']:g} must be above 0 seconds")
    if not 0.0 <= numbers["range_ratio"] < 1.0:
        raise ValueError(f"{where}: range_ratio {numbers['range_ratio']:g} must be in [0, 1): lengths are drawn "
                         "from [len * (1 - ratio), len * (1 + ratio)]")
    return Phase(ints["input_len"], ints["output_len"], float(numbers["request_rate"]),
                 float(numbers["duration_s"]), float(numbers["range_ratio"]))


def _parse_number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _phases_from_spec(text: str) -> list[Phase]:
    phases = []
    for index, item in enumerate(text.split(","), start=1):
        parts = item.strip().split(":")
        if len(parts) not in (4, 5):
            raise ValueError(f"--phases: phase {index} {item.strip()!r} has {len(parts)} fields, not 4 or 5: "
                             f"{SPEC_HELP}")
        phases.append(_phase_of(dict(zip(FIELDS, map(_parse_number, parts))), f"--phases: phase {index}"))
    return phases


def _phases_from_file(path: Path) -> list[Phase]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--phases {path}: cannot read it ({exc}): {SPEC_HELP}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--phases {path}: line {exc.lineno}: not valid JSON ({exc.msg}): {SPEC_HELP}") from exc
    if not isinstance(data, list) or not data:
        raise ValueError(f"--phases {path}: the top level is not a non-empty list: {SPEC_HELP}")
    phases = []
    for index, entry in enumerate(data, start=1):
        unknown = sorted(set(entry) - set(FIELDS)) if isinstance(entry, dict) else None
        if unknown is None or unknown:
            raise ValueError(f"--phases {path}: phase {index} is not an object of {', '.join(FIELDS)}"
                             + (f" (unknown: {', '.join(unknown)})" if unknown else "") + f": {SPEC_HELP}")
        phases.append(_phase_of(entry, f"--phases {path}: phase {index}"))
    return phases


def parse_phases(text: str) -> list[Phase]:
    """--phases: a JSON file when the text names one (or ends in .json), else the inline spec."""
    if text.endswith(".json") or Path(text).is_file():
        return _phases_from_file(Path(text))
    return _phases_from_spec(text)


def phase_windows(phases: list[Phase], cycles: int) -> list[PhaseWindow]:
    """The phases laid end to end, `cycles` times over: [num_phases * cycles] windows."""
    if cycles < 1:
        raise ValueError(f"--phase-cycles {cycles} must be at least 1")
    total_s = cycles * sum(phase.duration_s for phase in phases)
    if total_s > MAX_ARRIVAL_SPAN_S:
        raise ValueError(f"--phases with --phase-cycles {cycles} last {total_s:.3g} s, more than a day "
                         f"({MAX_ARRIVAL_SPAN_S:.0f} s): shorten the phases or use fewer cycles")
    windows, start = [], 0.0
    for cycle in range(1, cycles + 1):
        for index, phase in enumerate(phases, start=1):
            windows.append(PhaseWindow(index, cycle, start, start + phase.duration_s, phase))
            start += phase.duration_s
    return windows


def window_arrivals(windows: list[PhaseWindow], burstiness: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n] in seconds, window index [n]): each window's arrivals, gamma gaps of mean 1 / its rate
    from its start, the ones before its end kept; one seeded stream across the windows, in order."""
    rng = np.random.default_rng([seed, 1])  # the arrival stream of bench's other datasets
    offsets, owners = [], []
    for index, window in enumerate(windows):
        check_arrival_args(window.spec.request_rate, burstiness)
        scale = 1.0 / (window.spec.request_rate * burstiness)
        expected = window.spec.request_rate * (window.end_s - window.start_s)
        times, last = [], window.start_s
        while last < window.end_s:
            gaps = rng.gamma(shape=burstiness, scale=scale, size=int(expected + 4 * math.sqrt(expected)) + 8)
            batch = last + np.cumsum(gaps)
            times.append(batch[batch < window.end_s])
            last = batch[-1]
        kept = np.concatenate(times)
        offsets.append(kept)
        owners.append(np.full(kept.size, index))
    return np.concatenate(offsets), np.concatenate(owners).astype(np.int64)


def phased_samples(tokenizer, windows: list[PhaseWindow], owners: np.ndarray, seed: int) -> list[SampleRequest]:
    """One random-token prompt per arrival, with its window's lengths: [len(owners)] samples."""
    rng = np.random.default_rng(seed)
    pool = plain_token_ids(tokenizer)
    samples: list[SampleRequest | None] = [None] * owners.size
    for index, window in enumerate(windows):
        slots = np.flatnonzero(owners == index)
        spec = window.spec
        inputs = draw_lengths(rng, slots.size, spec.input_len, spec.range_ratio, "--phases input_len")
        outputs = draw_lengths(rng, slots.size, spec.output_len, spec.range_ratio, "--phases output_len")
        for slot, sample in zip(slots, random_prompts(tokenizer, pool, rng, inputs, outputs)):
            samples[slot] = sample
    return samples


def warmup_samples(tokenizer, phase: Phase, count: int, seed: int) -> list[SampleRequest]:
    """--warmup prompts shaped like the first phase's, from a stream of their own."""
    if count == 0:
        return []
    rng = np.random.default_rng([seed, 2])
    pool = plain_token_ids(tokenizer)
    inputs = draw_lengths(rng, count, phase.input_len, phase.range_ratio, "--phases input_len")
    outputs = draw_lengths(rng, count, phase.output_len, phase.range_ratio, "--phases output_len")
    return random_prompts(tokenizer, pool, rng, inputs, outputs)


def check_nonempty(owners: np.ndarray) -> None:
    if owners.size == 0:
        raise DatasetError("--phases: no request arrives in any phase: raise the rates or the durations")
