"""The adaptive policy's lean loop: how many dual-role engines lean to prefill (take prompts, no new decodes),
moved one engine at a time from the step model's verdict on the prompts routed in the last WINDOW_S (and, for one
engine fewer, in the last RETURN_WINDOW_S too).

    controller.observe(now, prefill_s)                                  every prompt routed
    controller.tick(now, addresses, num_decoding, split) -> [LeanChange]   every interval_s

The verdict (router/lean_split.py) carries its own hysteresis band; a clear one acts at the next tick. An
engine that changed keeps its lean for HOLD_S, so one window's evidence moves it once. At least one engine
never leans, and no engine leans to decode. docs/design/adaptive.md.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.router.adaptive import LEAN_DECODE, LEAN_NONE, LEAN_PREFILL

WINDOW_S = 8.0  # the verdict reads the prompts routed in the last WINDOW_S seconds
RETURN_WINDOW_S = 16.0  # and one engine fewer needs the verdict on this longer window too
HOLD_S = WINDOW_S  # an engine keeps a lean it was given this long
MAX_ARRIVALS = 100_000  # arrivals kept at most (the oldest go first)
LEAN_NAMES = {LEAN_DECODE: "decode", LEAN_NONE: "none", LEAN_PREFILL: "prefill"}

# (prompts per second, their mean prefill seconds, engines leaning to prefill) -> LEAN_PREFILL (one more),
# LEAN_DECODE (one fewer) or None (keep the split)
Split = Callable[[float, float, int], "int | None"]


@dataclass(frozen=True)
class LeanChange:
    address: str
    old: int
    new: int


class LeanController:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.leans: dict[str, int] = {}  # address -> lean; engines absent lean to none
        self._changed_at: dict[str, float] = {}  # address -> time of its last change
        self._arrivals: deque[tuple[float, float]] = deque(maxlen=MAX_ARRIVALS)  # (time, prefill s), RETURN_WINDOW_S
        self._window_prefill_s = 0.0  # their prefill seconds
        self._next_tick_at: float | None = None

    def lean(self, address: str) -> int:
        return self.leans.get(address, LEAN_NONE)

    def forget(self, address: str) -> None:
        """An engine left routing: it leans no more (a new one at its address starts without a lean)."""
        self.leans.pop(address, None)
        self._changed_at.pop(address, None)

    def observe(self, now: float, prefill_s: float) -> None:
        """A prompt is routed at `now` whose uncached part takes prefill_s to compute."""
        if len(self._arrivals) == self._arrivals.maxlen:
            self._window_prefill_s -= self._arrivals[0][1]
        self._arrivals.append((now, prefill_s))
        self._window_prefill_s += prefill_s

    def due(self, now: float) -> bool:
        if self._next_tick_at is None:
            self._next_tick_at = now + self.interval_s
        return now >= self._next_tick_at

    def tick(self, now: float, addresses: Sequence[str], num_decoding: dict[str, int], split: Split
             ) -> list[LeanChange]:
        """At most one of `addresses` (the dual-role engines in routing) changes its lean, as `split` says of the
        window's prompts. num_decoding: requests each engine decodes (the one decoding least turns to prefill)."""
        self._next_tick_at = now + self.interval_s
        self._expire(now)
        if not self._arrivals or len(addresses) < 2:  # nothing to judge by: the split stays
            return []
        leaning = sorted(a for a in addresses if self.lean(a) == LEAN_PREFILL)
        verdict = self._verdict(now, split, len(leaning))
        change = self._move(verdict, now, addresses, leaning, num_decoding)
        if change is None:
            return []
        if change.new == LEAN_NONE:
            self.leans.pop(change.address, None)
        else:
            self.leans[change.address] = change.new
        self._changed_at[change.address] = now
        return [change]

    def _verdict(self, now: float, split: Split, num_leaning: int) -> int | None:
        """The split's verdict on the last WINDOW_S of prompts; one engine fewer only if the last RETURN_WINDOW_S
        of prompts call for it too (None: keep the split, as without prompts)."""
        recent = list(itertools.takewhile(lambda arrival: arrival[0] > now - WINDOW_S, reversed(self._arrivals)))
        if not recent:
            return None
        verdict = split(len(recent) / WINDOW_S, sum(prefill_s for _, prefill_s in recent) / len(recent), num_leaning)
        if verdict != LEAN_DECODE:
            return verdict
        longer = split(len(self._arrivals) / RETURN_WINDOW_S, self._window_prefill_s / len(self._arrivals), num_leaning)
        return LEAN_DECODE if longer == LEAN_DECODE else None

    def _expire(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] <= now - RETURN_WINDOW_S:
            self._window_prefill_s -= self._arrivals.popleft()[1]
        if not self._arrivals:
            self._window_prefill_s = 0.0  # no float drift carried over an empty window

    def _move(self, verdict: int | None, now: float, addresses: Sequence[str], leaning: list[str],
              num_decoding: dict[str, int]) -> LeanChange | None:
        held = {a for a, at in self._changed_at.items() if now - at < HOLD_S}
        if verdict == LEAN_DECODE:
            back = [a for a in leaning if a not in held]
            return LeanChange(back[0], LEAN_PREFILL, LEAN_NONE) if back else None
        if verdict != LEAN_PREFILL or len(addresses) - len(leaning) < 2:  # keep one engine unleaning
            return None
        free = [a for a in addresses if self.lean(a) == LEAN_NONE and a not in held]
        if not free:
            return None
        target = min(free, key=lambda a: (num_decoding.get(a, 0), a))
        return LeanChange(target, LEAN_NONE, LEAN_PREFILL)
