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


def base_tpot_s(engine: EngineLoad, model: StepModel, horizon_tokens: float) -> float:
    """TPOT of the decodes running on the engine now: a decode step, plus its queued prompts spread over a
    request's output."""
    return model.decode_s(engine.num_decoding, engine.decode_context_tokens) + queue_s(engine, model) / horizon_tokens


def predict_ttft_s(prefill: EngineLoad, model: StepModel) -> float:
    """The queue ahead, the prompt itself, and the engine's decodes riding along in each of those steps."""
    num_steps = prefill.num_queued_prompts + 1
    return (queue_s(prefill, model) + model.prefill_s(prefill.uncached_tokens)
            + num_steps * model.decode_part_s(prefill.num_decoding, prefill.decode_context_tokens))


def evaluate(prefill: EngineLoad, decode: EngineLoad, num_prompt_tokens: int, model: StepModel, slo: Slo,
             horizon_tokens: float) -> Choice:
    """The predicted latencies and score of prefilling on `prefill` and decoding on `decode` (the same: colocated)."""
    local = prefill.address == decode.address
    ttft = predict_ttft_s(prefill, model)
    transfer = 0.0 if local else model.transfer_s(prefill.uncached_tokens)
    tpot = (model.decode_s(decode.num_decoding + 1, decode.decode_context_tokens + num_prompt_tokens)
            + (queue_s(decode, model) + transfer) / horizon_tokens)
    stall = model.prefill_s(prefill.uncached_tokens) / horizon_tokens  # per token of each decode on the prefill side
    marginal = model.decode_per_seq + model.decode_per_context_token * num_prompt_tokens  # on D's decodes
    stalled = [(prefill.num_decoding, base_tpot_s(prefill, model, horizon_tokens) + stall + (marginal if local else 0))]
    if not local:
        stalled.append((decode.num_decoding, base_tpot_s(decode, model, horizon_tokens) + marginal))
    tpot_ratio = max([tpot / slo.tpot_s] + [after / slo.tpot_s for count, after in stalled if count])
    ttft_ratio = ttft / slo.ttft_s
    harm = ttft_ratio + tpot / slo.tpot_s + prefill.num_decoding * (stall + (marginal if local else 0)) / slo.tpot_s
    if not local:
        harm += decode.num_decoding * marginal / slo.tpot_s
    harm += LEAN_PENALTY * _against_lean(prefill, decode, local)
    return Choice(None if local else prefill.address, decode.address, ttft, tpot, max(ttft_ratio, tpot_ratio), harm,
                  ttft_ratio, tpot_ratio)


def _against_lean(prefill: EngineLoad, decode: EngineLoad, local: bool) -> int:
    """How many of the engines are used against their lean: decodes on a prefill-leaning engine, and a
    decode-leaning engine prefilling for another."""
    return int(decode.lean == LEAN_PREFILL) + int(not local and prefill.lean == LEAN_DECODE)


def score(choice: Choice) -> tuple:
    """Lower is better: within the SLOs first (all that are tie), then the least harm; equal harm: colocated
    (no KV moves), then by address (deterministic)."""
    return max(choice.worst_ratio, 1.0), round(choice.harm, 9), not choice.local, choice.decode, choice.prefill or ""


def _fits(engine: EngineLoad, num_prompt_tokens: int) -> bool:
    return engine.kv_free_tokens >= num_prompt_tokens


def choose(num_prompt_tokens: int, engines: Sequence[EngineLoad], model: StepModel, slo: Slo,
           horizon_tokens: float, allow_remote_prefill: bool = True) -> Choice | None:
    """The best (prefill, decode) pair for a prompt of num_prompt_tokens; None when no engine can decode.
    Decode engines whose free KV cannot hold the prompt are passed over while another can."""
    decodes = [engine for engine in engines if engine.can_decode]
    decodes = [engine for engine in decodes if _fits(engine, num_prompt_tokens)] or decodes
    if not decodes:
        return None
    candidates = [evaluate(engine, engine, num_prompt_tokens, model, slo, horizon_tokens) for engine in decodes]
    prefills = [engine for engine in engines if engine.can_prefill] if allow_remote_prefill else []
    if prefills:
        best_prefills = _best(prefills, lambda p: _prefill_side_key(p, model, slo, horizon_tokens))
        best_decodes = _best(decodes, lambda d: _decode_side_key(d, num_prompt_tokens, model, slo, horizon_tokens))
        candidates += [evaluate(p, d, num_prompt_tokens, model, slo, horizon_tokens)
                       for p in best_prefills for d in best_decodes if p.address != d.address]
    return min(candidates, key=score)


def _best(engines: list[EngineLoad], key) -> list[EngineLoad]:
    return sorted(engines, key=lambda engine: (key(engine), engine.address))[:NUM_SIDE_CANDIDATES]


def _prefill_side_key(prefill: EngineLoad, model: StepModel, slo: Slo, horizon_tokens: float) -> tuple:
    """A prefill engine's own part of a disaggregated choice's score: the TTFT it gives and the TPOT of its decodes
    once stalled (over their SLOs, floored at 1), then the harm of those."""
    ttft_ratio = predict_ttft_s(prefill, model) / slo.ttft_s
    stall = model.prefill_s(prefill.uncached_tokens) / horizon_tokens
    stalled_ratio = (base_tpot_s(prefill, model, horizon_tokens) + stall) / slo.tpot_s if prefill.num_decoding else 0
    harm = ttft_ratio + prefill.num_decoding * stall / slo.tpot_s + LEAN_PENALTY * int(prefill.lean == LEAN_DECODE)
    return max(ttft_ratio, stalled_ratio, 1.0), harm


def _decode_side_key(decode: EngineLoad, num_prompt_tokens: int, model: StepModel, slo: Slo,
                     horizon_tokens: float) -> tuple:
    """A decode engine's own part: the new request's TPOT there and that of the decodes running there (over the
    SLO, floored at 1), then the harm of those."""
    tpot = model.decode_s(decode.num_decoding + 1, decode.decode_context_tokens + num_prompt_tokens)
    tpot += queue_s(decode, model) / horizon_tokens
    marginal = model.decode_per_seq + model.decode_per_context_token * num_prompt_tokens
    running_ratio = (base_tpot_s(decode, model, horizon_tokens) + marginal) / slo.tpot_s if decode.num_decoding else 0
    harm = (tpot + decode.num_decoding * marginal) / slo.tpot_s + LEAN_PENALTY * int(decode.lean == LEAN_PREFILL)
    return max(tpot / slo.tpot_s, running_ratio, 1.0), harm
