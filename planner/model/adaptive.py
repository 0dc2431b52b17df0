"""The adaptive router policy as the planner simulates it: N dual-role engines, and for each request the (prefill
engine, decode engine) pair, one engine when colocating, whose predicted outcome is best: the fewest predicted SLO
misses, then the least cost in SLO fractions (the request's TTFT and TPOT, and the TPOT its prefill and its decode add
to the requests already decoding on the engines). Predictions come from the step model and the engines' state at
the arrival; a pair of two engines pays the KV transfer. While prompts cost more beside decodes than the TPOT SLO
allows, the engines with the most recent prompt work lean to prefill (leaning_to_prefill). docs/design/planner-model.md
says what it assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.planner.model.simulator import SimEngine, SimRequest, StepModel

MISS_PENALTY = 100.0  # a predicted SLO miss outweighs any sum of SLO fractions
RECENT_TOKENS = 100  # an engine's recent prompt work: over the time a 100-token reply decodes at the TPOT SLO
RECENT_S_WITHOUT_TPOT = 10.0  # ... and without a TPOT SLO
MAX_BUSY = 0.95  # a share of prompt work at or above it reads as this (the decodes still get some steps)
LEAN_BUSY = 0.7  # engines leaning to prefill: the cluster's recent prompt work over this, rounded up (at most N - 1)
PROMPT_AVERAGE = 1 / 4  # weight of each arrival's prompt in the running mean of what prompts add to a step


@dataclass(frozen=True)
class AdaptiveTargets:
    """The SLOs the policy steers by, in seconds (inf: none given)."""
    ttft_s: float = math.inf
    tpot_s: float = math.inf

    @classmethod
    def from_slos_ms(cls, slos_ms: dict[str, float]) -> AdaptiveTargets:
        return cls(slos_ms.get("ttft", math.inf) / 1000.0, slos_ms.get("tpot", math.inf) / 1000.0)

    @property
    def recent_s(self) -> float:
        """The time constant of an engine's recent prompt work."""
        return RECENT_TOKENS * self.tpot_s if self.tpot_s < math.inf else RECENT_S_WITHOUT_TPOT


class RecentWork:
    """The share of an engine's time that its prompt work took recently: seconds of work, decayed exponentially with
    time constant tau, over tau."""

    def __init__(self, tau: float) -> None:
        self.tau, self.work, self.at = tau, 0.0, 0.0

    def add(self, now: float, seconds: float) -> None:
        self.work = self._decayed(now) + seconds
        self.at = now

    def share(self, now: float) -> float:
        return min(MAX_BUSY, self.rate(now))

    def rate(self, now: float) -> float:
        """Seconds of work a second, recently."""
        return self._decayed(now) / self.tau

    def _decayed(self, now: float) -> float:
        return self.work * math.exp(-(now - self.at) / self.tau) if now > self.at else self.work


@dataclass(frozen=True)
class EngineView:
    """What the policy reads of one engine at an arrival."""
    engine: SimEngine
    num_decoding: int  # requests decoding now
    num_inflight: int  # requests on it in any state (each will decode here or leave)
    attended: int  # tokens the next decode step reads
    queued_tokens: int  # prompt tokens not yet computed in full
    queued_work: float  # seconds those tokens add to the steps that compute them
    mean_remaining: float  # tokens the decoding requests have left, on average (>= 1)
    free_tokens: int  # KV pool tokens not in use or promised
    free_seats: int  # requests it may still take in before max_num_seqs
    prompt_share: float  # of its recent time, the share its prompt work took (RecentWork)


@dataclass(frozen=True)
class Side:
    """One engine's part in a choice: its predicted misses and cost (SLO fractions)."""
    misses: float
    cost: float

    @property
    def score(self) -> float:
        return self.misses * MISS_PENALTY + self.cost


class AdaptivePolicy:
    """Chooses (prefill engine or None for colocated, decode engine) for a request from the engines' views."""

    def __init__(self, model: StepModel, targets: AdaptiveTargets, token_budget: int, kv_bytes_per_token: int,
                 kv_streaming: bool) -> None:
        self.model, self.targets, self.token_budget = model, targets, token_budget
        self.kv_bytes_per_token, self.kv_streaming = kv_bytes_per_token, kv_streaming
        self.mean_chunk = 0.0  # running mean over arrivals of chunk_seconds(prompt)
        self.demand = RecentWork(targets.recent_s)  # the prompt work arriving: engines' worth of it, recently

    def choose(self, request: SimRequest, engines: list[SimEngine]) -> tuple[SimEngine | None, SimEngine]:
        views = [self.view_of(engine) for engine in engines]
        chunk = self.chunk_seconds(request.prompt_len)
        self.mean_chunk += PROMPT_AVERAGE * (chunk - self.mean_chunk)
        self.demand.add(request.arrival, self.model.prefill_intercept + chunk)
        leaning = set()
        if self.mean_chunk > self.targets.tpot_s:
            leaning = leaning_to_prefill(views, self.demand.rate(request.arrival))
        decoders = [replace(view, prompt_share=MAX_BUSY) if i in leaning else view for i, view in enumerate(views)]
        barred = [math.inf if leaning and i not in leaning else 0.0 for i in range(len(views))]
        prefill = [self.prefill_side(request, view, 0.0).score + bar for view, bar in zip(views, barred)]
        local = [self.decode_side(request, view, 0.0).score for view in decoders]
        colocated = min(range(len(views)), key=lambda i: prefill[i] + local[i])
        best = (prefill[colocated] + local[colocated], None, engines[colocated])
        if len(views) > 1:
            transfer, send = self.transfer_seconds(request), self.send_seconds(request.prompt_len)
            prefill = [self.prefill_side(request, view, send).score + bar for view, bar in zip(views, barred)]
            remote = [self.decode_side(request, view, transfer).score for view in decoders]
            for p in sorted(range(len(views)), key=prefill.__getitem__)[:2]:  # the best pair of two engines is
                for d in sorted(range(len(views)), key=remote.__getitem__)[:2]:  # among each side's best two
                    if p != d and prefill[p] + remote[d] < best[0]:
                        best = (prefill[p] + remote[d], engines[p], engines[d])
        return best[1], best[2]

    def view_of(self, engine: SimEngine) -> EngineView:
        num_decoding = len(engine.decoding)
        remaining = engine.remaining_tokens() / num_decoding if num_decoding else 1.0
        free = engine.capacity - engine.used_tokens() - engine.waiting_tokens
        queued = [r for r in engine.waiting if not engine.decodes_remote(r)] + engine.prefilling
        work = sum(self.model.prefill_per_token * (r.recompute_len - r.num_computed) + self.model.prefill_per_attention
                   * (r.recompute_len - r.num_computed) * (r.recompute_len + r.num_computed) for r in queued)
        work += sum(self.send_seconds(r.prompt_len) for r in queued if r.remote and r.prefill_engine is engine)
        inflight = engine.num_inflight()
        return EngineView(engine, num_decoding, inflight, engine.attended_tokens(), engine.queued_tokens, work,
                          max(1.0, remaining), free, engine.max_num_seqs - inflight,
                          engine.prompt_work.share(engine.env.now))

    # ---- predictions ----

    def chunk_seconds(self, prompt_len: int) -> float:
        """What a prompt's tokens add to the steps that compute them (beside their fixed part)."""
        model = self.model
        return model.prefill_per_token * prompt_len + model.prefill_per_attention * prompt_len * prompt_len

    def prompt_seconds(self, view: EngineView, prompt_len: int) -> float:
        """Until the engine has computed its queued prompts and this one: steps at its decode batch's step time (or
        prefill-only steps), plus the prompts' tokens."""
        tokens = view.queued_tokens + prompt_len
        room = max(1, self.token_budget - view.num_decoding)
        fixed = (self.model.decode_seconds(view.num_decoding, view.attended) if view.num_decoding
                 else self.model.prefill_intercept)
        return math.ceil(tokens / room) * fixed + view.queued_work + self.chunk_seconds(prompt_len)

    def engine_tpot(self, view: EngineView, extra_batch: int = 0, extra_context: float = 0.0,
                    extra_prefill: float = 0.0) -> float:
        """The engine's predicted time per decode token: its decode step, plus its queued prompts' tokens spread
        over the steps its decoding requests have left."""
        step = self.model.decode_seconds(view.num_decoding + extra_batch, view.attended + extra_context)
        return step + (view.queued_work + extra_prefill) / view.mean_remaining

    def harm(self, view: EngineView, before: float, after: float) -> Side:
        """The requests decoding on the engine, each slowed from `before` to `after` seconds a token: a predicted miss
        each when that takes them over the TPOT SLO."""
        if not view.num_decoding:
            return Side(0.0, 0.0)
        tpot = self.targets.tpot_s
        pushed_over = view.num_decoding if after > tpot >= before else 0
        return Side(pushed_over, view.num_decoding * (after - before) / tpot if tpot < math.inf else 0.0)

    def prefill_side(self, request: SimRequest, view: EngineView, send: float) -> Side:
        """The engine computes the prompt (and spends `send` seconds of its core sending the KV to a peer, 0
        colocated): the request's TTFT and its running decodes' harm."""
        ttft = self.prompt_seconds(view, request.prompt_len)
        before = self.engine_tpot(view)
        after = self.engine_tpot(view, extra_prefill=self.chunk_seconds(request.prompt_len) + send)
        harm = self.harm(view, before, after)
        late = ttft > self.targets.ttft_s or view.free_seats < 1  # (no seat: it waits for a request to finish)
        return Side(harm.misses + late, harm.cost + self._fraction(ttft, self.targets.ttft_s))

    def decode_side(self, request: SimRequest, view: EngineView, transfer: float) -> Side:
        """The engine decodes the request (its KV from a peer after `transfer` seconds, 0 colocated): the request's
        TPOT, its running decodes' harm, and whether its pool holds the request."""
        growth = request.prompt_len + request.output_len / 2
        before = self.engine_tpot(view)
        after = self.engine_tpot(view, 1, growth)
        steps = max(1, request.output_len - 1)
        step = self.model.decode_seconds(view.num_inflight + 1, view.attended + growth) / (1 - view.prompt_share)
        queued = view.queued_work if transfer else 0.0  # colocated: computed before its own prompt
        own = step + (queued + transfer) / steps
        harm = self.harm(view, before, after)
        full = request.prompt_len + request.output_len > view.free_tokens or view.free_seats < 1
        misses = harm.misses + (own > self.targets.tpot_s) + full
        return Side(misses, harm.cost + self._fraction(own, self.targets.tpot_s))

    def send_seconds(self, prompt_len: int) -> float:
        """The sending engine's CPU for a prompt's KV (the profile's link), taken before its next step."""
        return prompt_len * self.kv_bytes_per_token * self.model.sender_cpu_per_byte

    def transfer_seconds(self, request: SimRequest) -> float:
        model, num_bytes = self.model, request.prompt_len * self.kv_bytes_per_token
        wire = model.transfer_latency + (0.0 if self.kv_streaming else num_bytes * model.transfer_per_byte)
        return wire + num_bytes * model.receiver_cpu_per_byte

    @staticmethod
    def _fraction(value: float, limit: float) -> float:
        return value / limit if limit < math.inf else 0.0


def leaning_to_prefill(views: list[EngineView], demand: float) -> set[int]:
    """The engines that lean to prefill, used while prompts cost more than a token's TPOT: those with the most recent
    prompt work, as many as the prompt work arriving (engines' worth) over LEAN_BUSY, rounded up (at least one, at
    most all but one). Only they compute prompts, and a decode engine reads them as busy with prompts, so that the
    requests decoding there do not meet the next prompts; whoever computed the most prompts keeps leaning, which
    keeps the lean from flapping."""
    num_leaning = min(len(views) - 1, max(1, math.ceil(demand / LEAN_BUSY)))
    order = sorted(range(len(views)), key=lambda i: (-views[i].prompt_share, i))
    return set(order[:num_leaning])
