"""The decode steps a sweep run measured, against the profile's step for the batch they ran in: separates the
step-time model from the scheduling model in `plan --validate`.

A run records when each request was sent (its arrival, from the seed as bench draws it), its TTFT and its ITLs,
so the time of every token is known. At the middle of each later ITL (the second token's wait holds the KV
transfer) the requests between their first and last token are the decode batch, and each one's context is its
prompt plus the tokens it had. The profile's decode step for that batch (its context term as the backend reads
it: the sum, batch x the longest, or the sum plus the padding of its length groups) against the ITL measured is
the step model's error plus the machine's drift; the median over the run's ITLs is one figure per point. With
several decode engines, which request sat on which is not recorded: the batch, the summed context and the whole
batch's group padding are split evenly and the longest is the run's."""

from __future__ import annotations

import numpy as np

from pdserve.planner.model.host_effects import NO_HOST_EFFECTS, HostEffects
from pdserve.planner.model.simulator import StepModel
from pdserve.kernels.length_groups import group_padding
from pdserve.bench.serve_arrivals import arrival_offsets


def token_times(run: dict) -> list[np.ndarray]:
    """Per request, the seconds after the run's start at which each of its tokens arrived ([] if it failed)."""
    arrivals = arrival_offsets(len(run["ttfts"]), float(run["request_rate"]), float(run.get("burstiness") or 1.0),
                               int(run.get("seed") or 0))
    errors = run.get("errors") or [""] * len(run["ttfts"])
    return [np.array([]) if error else arrival + ttft + np.concatenate(([0.0], np.cumsum(itls)))
            for arrival, ttft, itls, error in zip(arrivals, run["ttfts"], run["itls"], errors)]


def step_ratio(run: dict, model: StepModel, num_decode: int, effects: HostEffects = NO_HOST_EFFECTS) -> float | None:
    """The median over the run's later ITLs of measured / the profile's decode step at the batch of the moment;
    None when the run has no later ITL."""
    times = token_times(run)
    measured, middles = [], []
    for stamps in times:
        gaps = np.diff(stamps)[1:]  # later ITLs: after the second token
        measured.append(gaps)
        middles.append(stamps[2:] - gaps / 2)
    if not any(len(gaps) for gaps in measured):
        return None
    middles_all, measured_all = np.concatenate(middles), np.concatenate(measured)
    contexts = _contexts_at(times, run["input_lens"], middles_all)
    batch, summed, longest = (contexts > 0).sum(axis=0), contexts.sum(axis=0), contexts.max(axis=0)
    per_engine = np.maximum(batch / num_decode, 1.0)
    if effects.decode_pads_to_longest:
        attended = per_engine * longest
    elif effects.decode_groups_by_length:  # the whole batch's grouping, split evenly like the rest
        padding = np.array([group_padding([int(c) for c in column[column > 0]]) for column in contexts.T])
        attended = (summed + padding) / num_decode
    else:
        attended = summed / num_decode
    return float(np.median(measured_all / model.decode_seconds(per_engine, attended)))


def _contexts_at(times: list[np.ndarray], prompt_lens: list[int], moments: np.ndarray) -> np.ndarray:
    """[requests, moments]: each request's context at each moment while it was decoding, else 0."""
    contexts = np.zeros((len(times), len(moments)), dtype=np.int64)
    for row, (stamps, prompt_len) in enumerate(zip(times, prompt_lens)):
        if len(stamps) < 2:
            continue
        active = (stamps[0] <= moments) & (moments <= stamps[-1])
        contexts[row] = np.where(active, prompt_len + np.searchsorted(stamps, moments, side="right"), 0)
    return contexts
