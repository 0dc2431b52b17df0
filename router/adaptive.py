"""The adaptive policy's choice for one request, as a pure function of engine states: which engine prefills
the prompt and which decodes it (the same engine: colocated), predicted with the step model.

    choose(num_prompt_tokens, engines, model, slo, horizon_tokens) -> Choice | None

For each candidate (P, D) it predicts the new request's TTFT and TPOT, and the TPOT of the decodes already
running on P and D once the prompt's prefill stalls them; a candidate is scored by (the worst of those over its
SLO, floored at 1: every choice within the SLOs ties there) then by the harm (the latency it adds to everyone,
in SLO units) plus any lean bias. Candidates: every decode-capable engine colocated, and the pairs of the two
best prefill-side and two best decode-side engines (O(engines), not every pair). docs/design/adaptive.md.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.router.step_model import StepModel

LEAN_DECODE, LEAN_NONE, LEAN_PREFILL = -1, 0, 1
LEAN_PENALTY = 0.5  # harm (SLO units) added to a choice against an engine's lean
NUM_SIDE_CANDIDATES = 2  # best engines per side paired for the disaggregated path


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.15


@dataclass(frozen=True)
class EngineLoad:
    """One engine as the router's ledger sees it now (no sockets: tests build these by hand)."""

    address: str
    can_prefill: bool  # prefill or dual role: may prefill for another engine
    can_decode: bool  # decode or dual role (a decode engine may always prefill its own requests)
    uncached_tokens: int  # of the prompt being routed, the tokens this engine's cache lacks
    queued_prefill_tokens: int = 0  # prompt tokens sent to it and not computed yet
    queued_prefill_squares: float = 0.0  # the sum of those prompts' squared lengths
    num_queued_prompts: int = 0
    num_decoding: int = 0  # requests it decodes
    decode_context_tokens: int = 0  # their tokens (prompt + generated)
    kv_free_tokens: int = 1 << 30  # KV tokens not held by requests open on it
    lean: int = LEAN_NONE


@dataclass(frozen=True)
class Choice:
    prefill: str | None  # None: the decode engine prefills the prompt (colocated)
    decode: str
    ttft_s: float  # predicted
    tpot_s: float  # predicted, the new request's
    worst_ratio: float  # the largest predicted latency over its SLO, the new request's and the stalled decodes'
    harm: float
    ttft_ratio: float
    tpot_ratio: float  # the worst TPOT over its SLO: the new request's, or of a decode it stalls

    @property
    def local(self) -> bool:
        return self.prefill is None


def queue_s(engine: EngineLoad, model: StepModel) -> float:
    """Seconds of prompt work queued on the engine ahead of a new prompt."""
    return model.prefill_s(engine.queued_prefill_tokens, engine.queued_prefill_squares, engine.num_queued_prompts)


class Predicted:
    """One engine's times for the request being routed, computed once: its queue, the prompt's prefill there,
    the TTFT if it prefills, and the TPOT of the decodes it runs now."""

    __slots__ = ("load", "queue_s", "prefill_s", "ttft_s", "base_tpot_s")

    def __init__(self, load: EngineLoad, model: StepModel, horizon_tokens: float) -> None:
        self.load = load
        self.queue_s = queue_s(load, model)
        self.prefill_s = model.prefill_s(load.uncached_tokens)
        # the queue ahead, the prompt itself, and the engine's decodes riding along in each of those steps
        num_steps = load.num_queued_prompts + 1
        self.ttft_s = (self.queue_s + self.prefill_s
                       + num_steps * model.decode_part_s(load.num_decoding, load.decode_context_tokens))
        # the decodes' step, plus the queued prompts spread over a request's output
        self.base_tpot_s = (model.decode_s(load.num_decoding, load.decode_context_tokens)
                            + self.queue_s / horizon_tokens)


@dataclass(frozen=True)
class Request:
    """What the choice for one prompt is judged with."""

    num_prompt_tokens: int
    model: StepModel
    slo: Slo
    horizon_tokens: float

    @property
    def marginal_s(self) -> float:
        """What one more sequence of this prompt adds to each decode step of an engine."""
        return self.model.decode_per_seq + self.model.decode_per_context_token * self.num_prompt_tokens

    def new_tpot_s(self, decode: Predicted) -> float:
        """The new request's TPOT on `decode` before any KV transfer: its step, plus the engine's queued prompts."""
        load = decode.load
        return (self.model.decode_s(load.num_decoding + 1, load.decode_context_tokens + self.num_prompt_tokens)
                + decode.queue_s / self.horizon_tokens)


def evaluate(prefill: EngineLoad, decode: EngineLoad, num_prompt_tokens: int, model: StepModel, slo: Slo,
             horizon_tokens: float) -> Choice:
    """The predicted latencies and score of prefilling on `prefill` and decoding on `decode` (the same: colocated)."""
    request = Request(num_prompt_tokens, model, slo, horizon_tokens)
    predicted_prefill = Predicted(prefill, model, horizon_tokens)
    predicted_decode = predicted_prefill if decode is prefill else Predicted(decode, model, horizon_tokens)
    return _evaluate(predicted_prefill, predicted_decode, request)


def _evaluate(prefill: Predicted, decode: Predicted, request: Request) -> Choice:
    slo, horizon = request.slo, request.horizon_tokens
    local = prefill.load.address == decode.load.address
    transfer = 0.0 if local else request.model.transfer_s(prefill.load.uncached_tokens)
    tpot = request.new_tpot_s(decode) + transfer / horizon
    stall = prefill.prefill_s / horizon  # per token of each decode on the prefill side
    marginal = request.marginal_s  # on each of D's decodes
    on_prefill = stall + (marginal if local else 0.0)
    tpot_ratio = tpot / slo.tpot_s
    if prefill.load.num_decoding:
        tpot_ratio = max(tpot_ratio, (prefill.base_tpot_s + on_prefill) / slo.tpot_s)
    if not local and decode.load.num_decoding:
        tpot_ratio = max(tpot_ratio, (decode.base_tpot_s + marginal) / slo.tpot_s)
    ttft_ratio = prefill.ttft_s / slo.ttft_s
    harm = ttft_ratio + tpot / slo.tpot_s + prefill.load.num_decoding * on_prefill / slo.tpot_s
    if not local:
        harm += decode.load.num_decoding * marginal / slo.tpot_s
    harm += LEAN_PENALTY * _against_lean(prefill.load, decode.load, local)
    return Choice(None if local else prefill.load.address, decode.load.address, prefill.ttft_s, tpot,
                  max(ttft_ratio, tpot_ratio), harm, ttft_ratio, tpot_ratio)


def _against_lean(prefill: EngineLoad, decode: EngineLoad, local: bool) -> int:
    """How many of the engines are used against their lean: decodes on a prefill-leaning engine, and a
    decode-leaning engine prefilling for another."""
    return int(decode.lean == LEAN_PREFILL) + int(not local and prefill.lean == LEAN_DECODE)


def score(choice: Choice) -> tuple:
    """Lower is better: within the SLOs first (all that are tie), then the least harm; equal harm: colocated
    (no KV moves), then by address (deterministic)."""
    return max(choice.worst_ratio, 1.0), round(choice.harm, 9), not choice.local, choice.decode, choice.prefill or ""


def choose(num_prompt_tokens: int, engines: Sequence[EngineLoad], model: StepModel, slo: Slo,
           horizon_tokens: float, allow_remote_prefill: bool = True) -> Choice | None:
    """The best (prefill, decode) pair for a prompt of num_prompt_tokens; None when no engine can decode.
    Decode engines whose free KV cannot hold the prompt are passed over while another can; so are engines leaning
    to prefill (their future prompts would stall every decode placed on them) while another can decode."""
    request = Request(num_prompt_tokens, model, slo, horizon_tokens)
    predicted = [Predicted(engine, model, horizon_tokens) for engine in engines]
    decodes = [p for p in predicted if p.load.can_decode]
    decodes = [p for p in decodes if p.load.kv_free_tokens >= num_prompt_tokens] or decodes
    decodes = [p for p in decodes if p.load.lean != LEAN_PREFILL] or decodes
    if not decodes:
        return None
    candidates = [_evaluate(engine, engine, request) for engine in decodes]
    prefills = [p for p in predicted if p.load.can_prefill] if allow_remote_prefill else []
    if prefills:
        best_prefills = _best(prefills, lambda p: _prefill_side_key(p, request))
        best_decodes = _best(decodes, lambda d: _decode_side_key(d, request))
        candidates += [_evaluate(p, d, request)
                       for p in best_prefills for d in best_decodes if p.load.address != d.load.address]
    return min(candidates, key=score)


def _best(engines: list[Predicted], key) -> list[Predicted]:
    return heapq.nsmallest(NUM_SIDE_CANDIDATES, engines, key=lambda engine: (key(engine), engine.load.address))


def _prefill_side_key(prefill: Predicted, request: Request) -> tuple:
    """A prefill engine's own part of a disaggregated choice's score: the TTFT it gives and the TPOT of its decodes
    once stalled (over their SLOs, floored at 1), then the harm of those."""
    slo, load = request.slo, prefill.load
    ttft_ratio = prefill.ttft_s / slo.ttft_s
    stall = prefill.prefill_s / request.horizon_tokens
    stalled_ratio = (prefill.base_tpot_s + stall) / slo.tpot_s if load.num_decoding else 0.0
    harm = ttft_ratio + load.num_decoding * stall / slo.tpot_s + LEAN_PENALTY * int(load.lean == LEAN_DECODE)
    return max(ttft_ratio, stalled_ratio, 1.0), harm


def _decode_side_key(decode: Predicted, request: Request) -> tuple:
    """A decode engine's own part: the new request's TPOT there and that of the decodes running there (over the
    SLO, floored at 1), then the harm of those."""
    slo, load = request.slo, decode.load
    tpot = request.new_tpot_s(decode)
    marginal = request.marginal_s
    running_ratio = (decode.base_tpot_s + marginal) / slo.tpot_s if load.num_decoding else 0.0
    harm = (tpot + load.num_decoding * marginal) / slo.tpot_s + LEAN_PENALTY * int(load.lean == LEAN_PREFILL)
    return max(tpot / slo.tpot_s, running_ratio, 1.0), harm
