"""The adaptive policy's slower loop: each engine's lean (to prefill, to decode, or none), moved by at most one
engine per interval from the SLO pressure the per-request choices predicted, with hysteresis.

    controller.observe(choice)                 every routed request
    controller.tick(now, addresses) -> [LeanChange]   at most one change per interval_s

Pressure = the mean predicted TTFT and TPOT over their SLOs of the interval's choices. TTFT pressure above
TPOT pressure by the margin, for CONFIRM_TICKS intervals in a row, moves one engine toward prefill (a decode-
leaning one back to none first); the reverse toward decode; no pressure for as long moves one back to none.
An engine that changed keeps its lean for DWELL_TICKS intervals. At least one engine never leans either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.router.adaptive import LEAN_DECODE, LEAN_NONE, LEAN_PREFILL, Choice

MARGIN = 0.25  # one pressure must exceed the other by this fraction
PRESSURE_FLOOR = 0.5  # below this (of the SLO) on both sides: no pressure
CONFIRM_TICKS = 2  # intervals the same verdict must hold before a lean moves
DWELL_TICKS = 3  # intervals an engine keeps a lean it was given
RATE_WEIGHT = 0.3  # weight of the last interval in the prompt rate the step model's verdict reads
LEAN_NAMES = {LEAN_DECODE: "decode", LEAN_NONE: "none", LEAN_PREFILL: "prefill"}


@dataclass(frozen=True)
class LeanChange:
    address: str
    old: int
    new: int


class LeanController:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.leans: dict[str, int] = {}  # address -> lean; engines absent lean to none
        self._changed_at: dict[str, int] = {}  # address -> tick of its last change
        self._tick = 0
        self._next_tick_at: float | None = None
        self._sums = [0.0, 0.0, 0]  # ttft ratios, tpot ratios, choices this interval
        self._prefill_s = 0.0  # the interval's prompts' own prefill times
        self._rate = self._busy = 0.0  # prompts per second and prefill seconds per second, averaged over intervals
        self._verdict, self._verdict_ticks = 0, 0

    def lean(self, address: str) -> int:
        return self.leans.get(address, LEAN_NONE)

    def forget(self, address: str) -> None:
        """An engine left routing: it leans no more (a new one at its address starts without a lean)."""
        self.leans.pop(address, None)
        self._changed_at.pop(address, None)

    def observe(self, choice: Choice) -> None:
        self._sums[0] += choice.ttft_ratio
        self._sums[1] += choice.tpot_ratio
        self._sums[2] += 1
        self._prefill_s += choice.prompt_prefill_s

    def due(self, now: float) -> bool:
        if self._next_tick_at is None:
            self._next_tick_at = now + self.interval_s
        return now >= self._next_tick_at

    def tick(self, now: float, addresses: Sequence[str], num_decoding: dict[str, int],
             split: Callable[[float, float, int], int | None] | None = None) -> list[LeanChange]:
        """Close the interval: at most one of `addresses` (the dual-role engines in routing) changes its lean.
        num_decoding: requests each engine decodes (an engine turned to prefill is the one decoding least; to
        decode, the one decoding most). split: the verdict from the step model instead of the SLO pressures,
        called with (prompts per second, their mean prefill seconds, engines leaning to prefill); None holds."""
        started = self._next_tick_at - self.interval_s if self._next_tick_at is not None else now - self.interval_s
        self._next_tick_at = now + self.interval_s
        self._tick += 1
        if split is None:
            verdict = self._read_pressure()
        else:
            verdict = self._split_verdict(split, max(now - started, 1e-3), addresses)
            if verdict is None:  # the split is right as it is
                self._verdict, self._verdict_ticks = LEAN_NONE, 0
                return []
        if verdict == self._verdict:
            self._verdict_ticks += 1
        else:
            self._verdict, self._verdict_ticks = verdict, 1
        if self._verdict_ticks < CONFIRM_TICKS or len(addresses) < 2:
            return []
        change = self._move(verdict, addresses, num_decoding)
        if change is None:
            return []
        self.leans[change.address] = change.new
        self._changed_at[change.address] = self._tick
        self._verdict_ticks = 0  # the next move needs a fresh confirmation
        return [change]

    def _split_verdict(self, split: Callable[[float, float, int], int | None], seconds: float,
                       addresses: Sequence[str]) -> int | None:
        """The step model's verdict on the recent prompts: their rate and prefill seconds per second averaged over
        the last intervals (RATE_WEIGHT each), so that an interval that happens to bring none undoes nothing."""
        count, prefill_s = self._sums[2], self._prefill_s
        self._sums, self._prefill_s = [0.0, 0.0, 0], 0.0
        self._rate += RATE_WEIGHT * (count / seconds - self._rate)
        self._busy += RATE_WEIGHT * (prefill_s / seconds - self._busy)
        if self._rate <= 0:
            return None
        leaning = sum(1 for a in addresses if self.lean(a) == LEAN_PREFILL)
        verdict = split(self._rate, self._busy / self._rate, leaning)
        return None if verdict == LEAN_DECODE and not leaning else verdict  # no engine leans to decode

    def _read_pressure(self) -> int:
        """LEAN_PREFILL when TTFT binds, LEAN_DECODE when TPOT does, LEAN_NONE when neither or no request came."""
        ttft_sum, tpot_sum, count = self._sums
        self._sums, self._prefill_s = [0.0, 0.0, 0], 0.0
        if count == 0:
            return LEAN_NONE
        ttft, tpot = ttft_sum / count, tpot_sum / count
        if max(ttft, tpot) < PRESSURE_FLOOR:
            return LEAN_NONE
        if ttft > tpot * (1 + MARGIN):
            return LEAN_PREFILL
        if tpot > ttft * (1 + MARGIN):
            return LEAN_DECODE
        return LEAN_NONE

    def _move(self, verdict: int, addresses: Sequence[str], num_decoding: dict[str, int]) -> LeanChange | None:
        movable = [a for a in addresses if self._tick - self._changed_at.get(a, -DWELL_TICKS) >= DWELL_TICKS]
        if verdict == LEAN_NONE:
            leaning = sorted(a for a in movable if self.lean(a) != LEAN_NONE)
            return LeanChange(leaning[0], self.lean(leaning[0]), LEAN_NONE) if leaning else None
        opposite = sorted(a for a in movable if self.lean(a) == -verdict)
        if opposite:
            return LeanChange(opposite[0], -verdict, LEAN_NONE)
        if sum(1 for a in addresses if self.lean(a) == LEAN_NONE) < 2:  # keep one engine unleaning
            return None
        free = [a for a in movable if self.lean(a) == LEAN_NONE]
        if not free:
            return None
        sign = 1 if verdict == LEAN_PREFILL else -1  # to prefill: the one decoding least
        target = min(free, key=lambda a: (sign * num_decoding.get(a, 0), a))
        return LeanChange(target, LEAN_NONE, verdict)
