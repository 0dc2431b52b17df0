"""The trace dataset of `pdserve bench`: a JSONL file of requests with their arrival offsets, replayed at
those offsets (`--dataset trace --dataset-path F`), and `--save-trace`, which writes a run's schedule as
such a file so that it can be replayed exactly.

One request per line, in order of arrival:
  {"arrival_s": 0.52, "prompt": "text", "output_len": 48}
  {"arrival_s": 0.61, "prompt_token_ids": [101, 7, ...], "output_len": 48}   (with "prompt" too, optionally)
  {"arrival_s": 0.90, "input_len": 1000, "output_len": 48}                    (random tokens, from --seed)
"phase" (a number or a name) and "cycle" label the phase a request arrived in, for per-phase results.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.serve_datasets import DatasetError, SampleRequest, plain_token_ids, random_prompts, read_text
from pdserve.bench.serve_phases import PhaseWindow

FIELDS = ("arrival_s", "prompt", "prompt_token_ids", "input_len", "output_len", "phase", "cycle")
EXAMPLE = '{"arrival_s": 0.5, "input_len": 1000, "output_len": 48}'


@dataclass(frozen=True)
class TraceLine:
    arrival_s: float  # seconds after the start of the measured load
    output_len: int
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    input_len: int | None = None  # random tokens instead of a given prompt
    phase: int | str | None = None
    cycle: int = 0  # 0: no cycle given


def _whole(value, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


class _LineChecker:
    """Checks one trace line's fields; every error names the file, the line and the fix."""

    def __init__(self, path: str | Path, line_number: int) -> None:
        self.where = f"{path}: line {line_number}"

    def fail(self, problem: str, fix: str) -> DatasetError:
        return DatasetError(f"{self.where}: {problem}: {fix}")

    def arrival(self, record: dict, previous: float) -> float:
        value = record.get("arrival_s")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self.fail(f'"arrival_s" {value!r} is not a number of seconds >= 0',
                            f"give each line its arrival offset from the start, e.g. {EXAMPLE}")
        if value < previous:
            raise self.fail(f'"arrival_s" {value:g} comes before the line above ({previous:g})',
                            "sort the lines by arrival_s")
        return float(value)

    def prompt(self, record: dict) -> tuple[str | None, tuple[int, ...] | None, int | None]:
        text, ids, length = record.get("prompt"), record.get("prompt_token_ids"), record.get("input_len")
        if text is None and ids is None and length is None:
            raise self.fail('no prompt', f'give "prompt" (text), "prompt_token_ids" or "input_len", e.g. {EXAMPLE}')
        if length is not None and (text is not None or ids is not None):
            raise self.fail('"input_len" with a prompt', 'give "input_len" (random tokens) or the prompt, not both')
        if text is not None and (not isinstance(text, str) or not text):
            raise self.fail('"prompt" is not a non-empty string', 'write the prompt text, or use "prompt_token_ids"')
        if ids is not None and (not isinstance(ids, list) or not ids or not all(_whole(i, 0) for i in ids)):
            raise self.fail('"prompt_token_ids" is not a non-empty list of token ids >= 0',
                            'write e.g. "prompt_token_ids": [101, 2023, 2003]')
        if length is not None and not _whole(length, 1):
            raise self.fail(f'"input_len" {length!r} is not a whole number of tokens >= 1', f"write e.g. {EXAMPLE}")
        return text, tuple(ids) if ids is not None else None, length

    def output_len(self, record: dict, default: int | None) -> int:
        value = record.get("output_len", default)
        if not _whole(value, 1):
            raise self.fail(f'"output_len" {value!r} is not a whole number of tokens >= 1',
                            f"give each line its output_len (or pass --output-len), e.g. {EXAMPLE}")
        return value

    def phase(self, record: dict) -> tuple[int | str | None, int]:
        phase, cycle = record.get("phase"), record.get("cycle")
        if phase is not None and not (_whole(phase, 1) or (isinstance(phase, str) and phase)):
            raise self.fail(f'"phase" {phase!r} is neither a number >= 1 nor a name', 'write e.g. "phase": 1')
        if cycle is not None and (phase is None or not _whole(cycle, 1)):
            raise self.fail(f'"cycle" {cycle!r} needs a "phase" and must be a number >= 1',
                            'write e.g. "phase": 1, "cycle": 2, or leave "cycle" out')
        return phase, cycle or 0


def _trace_line(record, checker: _LineChecker, previous: float, default_output_len: int | None) -> TraceLine:
    if not isinstance(record, dict):
        raise checker.fail(f"a JSON {type(record).__name__}, not an object",
                           f"write one object per line, e.g. {EXAMPLE}")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise checker.fail(f"unknown field {', '.join(map(repr, unknown))}", f"use only {', '.join(FIELDS)}")
    text, ids, length = checker.prompt(record)
    phase, cycle = checker.phase(record)
    return TraceLine(checker.arrival(record, previous), checker.output_len(record, default_output_len), text, ids,
                     length, phase, cycle)


def read_trace(path: str | Path, default_output_len: int | None = None) -> list[TraceLine]:
    """The trace's requests in file order; a bad line is a DatasetError with its number and the fix."""
    lines: list[TraceLine] = []
    for line_number, text in enumerate(read_text(path, "JSONL trace").splitlines(), start=1):
        if not text.strip():
            continue
        checker = _LineChecker(path, line_number)
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise checker.fail(f"not valid JSON ({exc.msg})", f"write one object per line, e.g. {EXAMPLE}") from exc
        lines.append(_trace_line(record, checker, lines[-1].arrival_s if lines else 0.0, default_output_len))
        if (lines[-1].phase is None) != (lines[0].phase is None):
            raise checker.fail('"phase" is on some lines and not on others', 'label every line with its phase, or none')
    if not lines:
        raise DatasetError(f"{path}: no requests in it: write one request per line, e.g. {EXAMPLE}")
    return lines


def trace_samples(lines: Sequence[TraceLine], tokenizer, seed: int, path: str | Path) -> list[SampleRequest]:
    """The lines' requests: given prompts as they are, input_len ones as random tokens drawn from seed."""
    needs_tokenizer = any(line.input_len is not None or line.prompt is None for line in lines)
    if needs_tokenizer and tokenizer is None:
        raise DatasetError(f"{path}: lines with input_len or only prompt_token_ids need a tokenizer: pass --tokenizer")
    rng = np.random.default_rng(seed)
    pool = plain_token_ids(tokenizer) if any(line.input_len is not None for line in lines) else None
    samples = []
    for line in lines:
        if line.input_len is not None:
            samples += random_prompts(tokenizer, pool, rng, [line.input_len], [line.output_len])
        elif line.prompt_token_ids is not None:
            text = line.prompt if line.prompt is not None else tokenizer.decode(list(line.prompt_token_ids))
            samples.append(SampleRequest(text, len(line.prompt_token_ids), line.output_len, line.prompt_token_ids))
        else:
            count = len(tokenizer.encode(line.prompt, add_special_tokens=False)) if tokenizer is not None else None
            samples.append(SampleRequest(line.prompt, count, line.output_len))
    return samples


def trace_windows(lines: Sequence[TraceLine]) -> tuple[list[PhaseWindow], list[int] | None]:
    """(windows, window index per line): a window is a run of consecutive lines with the same phase and cycle,
    from its first arrival to the next window's (its own last, for the last one); none without labels."""
    if lines[0].phase is None:
        return [], None
    starts = [i for i, line in enumerate(lines)
              if i == 0 or (line.phase, line.cycle) != (lines[i - 1].phase, lines[i - 1].cycle)]
    windows, owners = [], []
    for number, first in enumerate(starts):
        after = starts[number + 1] if number + 1 < len(starts) else len(lines)
        end = lines[after].arrival_s if after < len(lines) else lines[-1].arrival_s
        windows.append(PhaseWindow(lines[first].phase, lines[first].cycle, lines[first].arrival_s, end))
        owners += [number] * (after - first)
    return windows, owners


def write_trace(path: str | Path, samples: Sequence[SampleRequest], offsets: Sequence[float],
                windows: Sequence[PhaseWindow] = (), owners: Sequence[int] | None = None) -> Path:
    """The measured schedule as a trace: each request's arrival, prompt (text and ids) and output length, and
    its phase and cycle when the run has phases. Replaying it sends the same requests at the same offsets."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as file:
        for index, (sample, offset) in enumerate(zip(samples, offsets)):
            record: dict = {"arrival_s": float(offset), "prompt": sample.prompt}
            if sample.prompt_token_ids is not None:
                record["prompt_token_ids"] = [int(i) for i in sample.prompt_token_ids]
            record["output_len"] = sample.output_len
            if owners is not None:
                window = windows[owners[index]]
                record["phase"] = window.phase
                if window.cycle:
                    record["cycle"] = window.cycle
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    return out
