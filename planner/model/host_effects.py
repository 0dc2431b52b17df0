"""What a CPU host adds to the physical step model, behind one interface (docs/benchmarking/plan.md, "what the
model assumes"):

- engines on cores of one host slow each other's decode steps: the co-run factors of a step's weights part and KV
  reads while another engine computes prompts, or runs decode steps;
- the router and the clients take CPU from the engines' cores once none is idle: per streamed token, and a share of
  a core all along;
- the CPU decode attention reads each group of similar lengths padded to its longest (or, in older profiles, the
  whole batch padded to its longest);
- a profile taken at another speed than the sweep or the cluster planned for: --step-scale, --per-point-speed.

One switch (`host_effects`): a CPU profile gets them, a GPU profile (engines on devices of their own) or
`--no-host-effects` gets NO_HOST_EFFECTS, whose host changes no step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdserve.planner.model.host_cpu import NO_HOST_CPU, HostCpu
from pdserve.planner.profile.corun_fit import NO_CORUN, CoRun
from pdserve.planner.profile.fit import Profile

if TYPE_CHECKING:
    from pdserve.planner.model.simulator import SimEngine, SimRequest, StepModel

IDLE, DECODING, PREFILLING = "idle", "decoding", "prefilling"  # an engine's step under way


@dataclass(frozen=True)
class HostEffects:
    """The CPU host's figures: NO_HOST_EFFECTS (all neutral) for a GPU profile or with the effects switched off."""
    step_scale: tuple[float, float] = (1.0, 1.0)  # prefill, decode step times x these (1 = as profiled)
    corun: CoRun = NO_CORUN  # a decode step's slow-down while another engine of the host computes prompts
    beside_decode: CoRun = NO_CORUN  # ... while another engine of the host runs decode steps
    cpu_per_token: float = 0.0  # seconds of host CPU (router, clients) per streamed token
    background_cores: float = 0.0  # ... and CPU seconds per second whatever the load
    decode_pads_to_longest: bool = False  # the decode context term counts batch x the longest
    decode_groups_by_length: bool = False  # ... the sum plus each length group's padding (the CPU backend)

    def scaled(self, model: StepModel) -> StepModel:
        """The step model with its prefill and decode terms times step_scale (transfers are not scaled)."""
        prefill, decode = self.step_scale
        if (prefill, decode) == (1.0, 1.0):
            return model
        return replace(model, prefill_intercept=model.prefill_intercept * prefill,
                       prefill_per_token=model.prefill_per_token * prefill,
                       prefill_per_attention=model.prefill_per_attention * prefill,
                       decode_intercept=model.decode_intercept * decode, decode_per_seq=model.decode_per_seq * decode,
                       decode_per_context=model.decode_per_context * decode)

    def with_speed(self, speed: tuple[float, float]) -> HostEffects:
        """The step scale times the machine's speed of the moment (prefill, decode): --per-point-speed."""
        return replace(self, step_scale=(self.step_scale[0] * speed[0], self.step_scale[1] * speed[1]))

    def unshared(self) -> HostEffects:
        """Without what engines sharing one host do to each other: one engine per tier of a large cluster, whose
        sharing of hosts is not known."""
        return replace(self, corun=NO_CORUN, beside_decode=NO_CORUN, cpu_per_token=0.0, background_cores=0.0)

    def host_of(self, engines: list[SimEngine]) -> SharedHost | NoHost:
        """The host the engines of one simulated cluster share while it runs."""
        host = SharedHost(self, engines)
        return host if host.tracks_activity else NO_HOST


NO_HOST_EFFECTS = HostEffects()


class NoHost:
    """A host of its own per engine: no step changes (a GPU profile)."""
    tracks_activity = False

    def slowdown(self, engine: SimEngine) -> CoRun:
        return NO_CORUN

    def charge(self, seconds: float, num_decodes: int, chunks: list[tuple[SimRequest, int]] = ()) -> float:
        return seconds

    def set_activity(self, engine: SimEngine, activity: str) -> None:
        engine.activity = activity


NO_HOST = NoHost()


class SharedHost:
    """The engines of one CPU host. While another engine computes a step with prompt tokens, an engine's decode steps
    take the co-run factors times as long (one for the weights part, one for the KV reads); while another runs decode
    steps, the beside-decode factors (term by term the larger where both apply). A step is timed when it starts, and
    a decode run is cut at its next step boundary when what the others do changes.

    The host's cores are the engines' (one each, as `pdserve sweep` pins them on CPU). The router and the clients take
    cpu_per_token per token streamed and background_cores all along: on an idle engine's core while there is one,
    else from the busy engines, each paying for the tokens its own step streams and its share of the background."""

    def __init__(self, effects: HostEffects, engines: list[SimEngine]) -> None:
        self.engines = engines
        self.factors = {PREFILLING: effects.corun.at_least(NO_CORUN),  # a neighbour never speeds a step up
                        DECODING: effects.beside_decode.at_least(NO_CORUN)}
        num_engines = len(engines)
        self.cpu_per_token = effects.cpu_per_token
        share = effects.background_cores / num_engines  # of each busy core
        if not 0 <= share < 1:
            raise ValueError(f"host background CPU {effects.background_cores:g} cores on {num_engines} engines' "
                             "cores: give less than one core per engine")
        self.stretch = 1.0 / (1.0 - share)
        self.charged = self.cpu_per_token > 0 or self.stretch > 1.0
        self.tracks_activity = (num_engines > 1 and any(f != NO_CORUN for f in self.factors.values())
                                or self.charged)  # engines report their activity (set_activity)
        self.num_at = {PREFILLING: 0, DECODING: 0, IDLE: num_engines}  # engines by activity

    def slowdown(self, engine: SimEngine) -> CoRun:
        """How many times as long engine's decode part takes, term by term, with what the other engines do now."""
        slowdown = NO_CORUN
        for activity, factor in self.factors.items():
            if self.num_at[activity] > (engine.activity == activity):
                slowdown = factor if slowdown is NO_CORUN else slowdown.at_least(factor)
        return slowdown

    def charge(self, seconds: float, num_decodes: int, chunks: list[tuple[SimRequest, int]] = ()) -> float:
        """A step of `seconds` with the host's CPU on its core: as it is while an engine (its core) is idle, else
        stretched by its core's share of the background, plus the CPU for the tokens it streams (one per decode, one
        per prompt its chunks complete). Called once the engine has set its own activity."""
        if self.num_at[IDLE] or not self.charged:
            return seconds
        first_tokens = sum(r.num_computed + n >= r.recompute_len for r, n in chunks) if chunks else 0
        return seconds * self.stretch + (num_decodes + first_tokens) * self.cpu_per_token

    def set_activity(self, engine: SimEngine, activity: str) -> None:
        """engine starts a step (or a run) of this activity; the others' decode runs end at their next step
        boundary when another engine starts or stops doing something that slows them."""
        before = engine.activity
        if before == activity:
            return
        engine.activity = activity
        self.num_at[before] -= 1
        self.num_at[activity] += 1
        if self._others_see_a_change(before, self.num_at[before] + 1, self.num_at[before]) or \
                self._others_see_a_change(activity, self.num_at[activity] - 1, self.num_at[activity]):
            for other in self.engines:
                if other is not engine:
                    other.speed_changed()

    def _others_see_a_change(self, activity: str, count_before: int, count_after: int) -> bool:
        """Whether the engines with decode runs (DECODING ones) see "another engine does this" flip: a count
        moving 0 <-> 1 for what they do not do, 1 <-> 2 for decoding, which they do (their own step counts); for
        IDLE, 0 <-> 1 where the host's CPU is charged (a core free for it, or none)."""
        if activity == IDLE:
            return self.charged and min(count_before, count_after) == 0
        if self.factors.get(activity, NO_CORUN) == NO_CORUN:
            return False
        return min(count_before, count_after) == (1 if activity == DECODING else 0)


def host_effects(args: argparse.Namespace, profile: Profile, host: HostCpu = NO_HOST_CPU) -> HostEffects:
    """The switch: a CPU profile's effects (its co-run factors and attention padding, the host's CPU, --step-scale),
    unless --no-host-effects; NO_HOST_EFFECTS for a GPU profile, which refuses the flags that would set them."""
    prefill_scale, decode_scale = args.step_scale
    if not (prefill_scale > 0 and decode_scale > 0):
        raise ValueError(f"--step-scale {prefill_scale:g} {decode_scale:g}: both scales must be above 0 "
                         "(1 = as profiled)")
    given = [flag for flag, value in (("--step-scale", tuple(args.step_scale) != (1.0, 1.0)),
                                      ("--per-point-speed", args.per_point_speed),
                                      ("--host-cpu-per-token", args.host_cpu_per_token is not None),
                                      ("--host-background-cpu", args.host_background_cpu is not None),
                                      ("--host-cpu-from", args.host_cpu_from is not None)) if value]
    if args.no_host_effects or not profile.on_cpu:
        if given:
            why = "--no-host-effects switches them off" if args.no_host_effects else \
                "the profile is a GPU's, whose engines share no CPU host"
            raise ValueError(f"{', '.join(given)}: a CPU host's effects, and {why}; drop {' and '.join(given)}")
        return NO_HOST_EFFECTS
    return HostEffects((prefill_scale, decode_scale), profile.decode_corun, profile.decode_beside_decode,
                       host.seconds_per_token, host.background_cores, profile.engine.decode_pads_to_longest,
                       profile.decode_groups_by_length)
