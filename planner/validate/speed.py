"""How fast the machine was around each point of a sweep, from its reference runs (`pdserve sweep
--reference-requests K`: K requests one at a time before each load and after a server's last).

Per reference run: each request's TTFT against the simulator's TTFT for it alone on the run's layout (the prefill
speed), and its later ITLs (after the second token) against the simulated ones (the decode speed); the median
over the run's requests. A point takes the geometric mean of the reference runs on either side of it, a few
minutes apart. `pdserve plan --validate --per-point-speed` scales the profile's prefill and decode steps by them:
what is left is the model's error at the machine's speed of that moment, not the drift between the hour of the
profile and the hour of the sweep (docs/results.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pdserve.planner.model.host_effects import NO_HOST_EFFECTS, HostEffects
from pdserve.planner.model.simulator import ClusterSpec, StepModel, simulate
from pdserve.bench.sweep_results import REFERENCE_PHASE


@dataclass(frozen=True)
class Speed:
    """Measured over the profile's step time: 1.2 = the machine took 20% longer than the profile says."""
    prefill: float
    decode: float | None  # None: no request had a later ITL (output of 2 tokens or fewer)


@dataclass(frozen=True)
class ReferenceSpeed:
    config: str
    order: int  # the run's place among its server's runs
    speed: Speed


def reference_speed(run: dict, model: StepModel, cluster: ClusterSpec, effects: HostEffects = NO_HOST_EFFECTS
                    ) -> Speed | None:
    """One reference run against the profile; None when none of its requests completed."""
    sweep = run["sweep"]
    spec = replace(cluster, num_prefill=int(sweep["num_prefill"]), num_decode=int(sweep["num_decode"]))
    errors = run.get("errors") or [""] * len(run["ttfts"])
    prefill, decode = [], []
    for prompt, output, ttft, itls, error in zip(run["input_lens"], run["output_lens"], run["ttfts"], run["itls"],
                                                 errors):
        if error or not ttft:
            continue
        alone, = simulate(spec, model, [0.0], [int(prompt)], [max(int(output), 1)], effects=effects)
        prefill.append(ttft / alone.ttft)
        if len(itls) > 1 and alone.second_token is not None and alone.finish > alone.second_token:
            decode.append(sum(itls[1:]) / (alone.finish - alone.second_token))
    if not prefill:
        return None
    return Speed(float(np.median(prefill)), float(np.median(decode)) if decode else None)


def reference_speeds(all_runs: list[dict], model: StepModel, cluster: ClusterSpec,
                     effects: HostEffects = NO_HOST_EFFECTS) -> list[ReferenceSpeed]:
    """Every reference run of a sweep that measured something, with its place in its server's order."""
    found = []
    for run in all_runs:
        sweep = run.get("sweep") or {}
        if sweep.get("phase") != REFERENCE_PHASE or sweep.get("order") is None or not run.get("ttfts"):
            continue
        speed = reference_speed(run, model, cluster, effects)
        if speed is not None:
            found.append(ReferenceSpeed(run["config"], int(sweep["order"]), speed))
    return found


def speed_around(run: dict, references: Sequence[ReferenceSpeed]) -> Speed | None:
    """The geometric mean of the nearest reference run before this run and the nearest after it (one side when
    the other is missing); None when the run has no order or its server has no reference run."""
    order = (run.get("sweep") or {}).get("order")
    if order is None:
        return None
    mine = [ref for ref in references if ref.config == run["config"]]
    before = max((ref for ref in mine if ref.order < order), key=lambda ref: ref.order, default=None)
    after = min((ref for ref in mine if ref.order > order), key=lambda ref: ref.order, default=None)
    sides = [ref.speed for ref in (before, after) if ref is not None]
    if not sides:
        return None
    decodes = [speed.decode for speed in sides if speed.decode is not None]
    return Speed(_geometric_mean([speed.prefill for speed in sides]), _geometric_mean(decodes) if decodes else None)


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(value) for value in values) / len(values))
