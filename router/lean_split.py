"""How many dual-role engines should lean to prefill: the step model's prediction of the worst latency over its
SLO with k engines taking the prompts and the others decoding, for the k now leaning and one more or one fewer.

    split_verdict(work, k) -> LEAN_PREFILL (one more), LEAN_DECODE (one fewer), or None (keep k)

SLO attainment is judged at its 90th percentile, so the TPOT is that of a decode hit by the 90th percentile
number of prefills. With k = 0 (every engine colocated) the prompts arrive on each engine at rate / n, a
decode lives horizon steps, and each prefill on its engine stalls it for the prompt's prefill time, spread over
its horizon tokens: a Poisson count of stalls. With k >= 1 the decodes run on the n - k others (a bigger batch
each), and the k engines take the prompts up to the utilisation at which TTFT reaches its SLO; prompts beyond
that spill onto the decoding engines and stall them as above. TTFT grows with each side's prompt utilisation.
A move must cut the predicted ratio by 10%: within that band either way the split stays (hysteresis); so does a
split predicted within half of every SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.router.adaptive import LEAN_DECODE, LEAN_PREFILL, Slo
from pdserve.router.step_model import StepModel

MORE_PREFILL_GAIN = 0.10  # one more prefill engine must cut the predicted worst ratio by this fraction
FEWER_PREFILL_GAIN = 0.10  # and one fewer by this: within that band either way, the split stays
MIN_IDLE = 0.05  # utilisation is capped at 95% in the queueing factors
QUANTILE = 0.9  # the share of requests the SLOs are for
MIN_RATIO = 0.5  # a split predicted within half of every SLO stays as it is


@dataclass(frozen=True)
class SplitWork:
    """The load of the lean's window and now, as the router's ledger has it."""

    num_engines: int  # dual-role engines in routing
    prompt_rate: float  # prompts routed per second
    mean_prefill_s: float  # a routed prompt's own prefill time
    num_decoding: int  # requests decoding over all engines
    decode_context_tokens: int  # their tokens
    horizon_tokens: float  # a request's output tokens

    @property
    def prefill_busy(self) -> float:
        """Seconds of prompt work routed per second (one engine's worth = 1.0)."""
        return self.prompt_rate * self.mean_prefill_s


def predicted_ratio(work: SplitWork, num_prefill: int, model: StepModel, slo: Slo) -> float:
    """The worst of predicted TTFT and TPOT over their SLOs with num_prefill engines leaning to prefill. Those carry
    the prompts up to the utilisation at which a prompt's TTFT reaches its SLO; the rest spill onto the decoding
    engines (the per-request choice colocates a prompt that a deep queue would make late), stalling their decodes."""
    num_decoders = work.num_engines - num_prefill
    if num_decoders < 1 or num_prefill < 0:
        return math.inf
    per_engine = max(1, math.ceil(work.num_decoding / num_decoders))
    step = model.decode_s(per_engine, work.decode_context_tokens // num_decoders)
    capacity = num_prefill * max(1.0 - work.mean_prefill_s / slo.ttft_s, 0.0)
    carried = min(work.prefill_busy, capacity)
    spilled = work.prefill_busy - carried
    ttft = work.mean_prefill_s / max(1.0 - carried / num_prefill, MIN_IDLE) if carried > 0 else 0.0
    tpot = step
    if spilled > 0:  # the prefills that land on a decode's engine during its life
        ttft = max(ttft, work.mean_prefill_s / max(1.0 - spilled / num_decoders, MIN_IDLE))
        spilled_rate = spilled / work.mean_prefill_s / num_decoders
        stalls = poisson_quantile(spilled_rate * work.horizon_tokens * step, QUANTILE)
        tpot += stalls * work.mean_prefill_s / work.horizon_tokens
    return max(ttft / slo.ttft_s, tpot / slo.tpot_s)


def poisson_quantile(mean: float, quantile: float) -> int:
    """The smallest count whose Poisson(mean) CDF reaches `quantile` (normal approximation past a mean of 50)."""
    if mean <= 0:
        return 0
    if mean > 50:
        return math.ceil(mean + 1.2816 * math.sqrt(mean))
    term = cdf = math.exp(-mean)
    count = 0
    while cdf < quantile:
        count += 1
        term *= mean / count
        cdf += term
    return count


def split_verdict(work: SplitWork, num_prefill: int, model: StepModel, slo: Slo) -> int | None:
    """LEAN_PREFILL when one more prefill-leaning engine is predicted clearly better, LEAN_DECODE when one fewer
    is, None (keep the split) otherwise."""
    now = predicted_ratio(work, num_prefill, model, slo)
    if now < MIN_RATIO:  # far within the SLOs: nothing to gain that matters
        return None
    more = predicted_ratio(work, num_prefill + 1, model, slo)
    if more < now * (1 - MORE_PREFILL_GAIN):
        return LEAN_PREFILL
    if num_prefill > 0 and predicted_ratio(work, num_prefill - 1, model, slo) < now * (1 - FEWER_PREFILL_GAIN):
        return LEAN_DECODE
    return None
