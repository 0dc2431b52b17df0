"""Slows API-key guessing: each client address has a small bucket of authentication failures that
refills with time; while it is empty, that address is answered 429 with Retry-After before its key is
even compared. The addresses are kept in least-recently-failed order, at most MAX_CLIENTS of them.

    throttle = AuthThrottle()
    wait_s = throttle.wait_s(address)   # > 0: answer 429 with Retry-After: wait_s
    throttle.failed(address)            # after a wrong or missing key
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

BURST = 10  # failures an address may make at once
REFILL_PER_S = 1.0  # then one more per second
MAX_CLIENTS = 4096  # addresses remembered; the least recently failed one is forgotten first


class AuthThrottle:
    def __init__(self, burst: int = BURST, refill_per_s: float = REFILL_PER_S, max_clients: int = MAX_CLIENTS,
                 clock=time.monotonic) -> None:
        self.burst, self.refill_per_s, self.max_clients, self.clock = burst, refill_per_s, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, at time)

    def _tokens(self, address: str) -> float:
        tokens, at = self._buckets.get(address, (self.burst, self.clock()))
        return min(self.burst, tokens + (self.clock() - at) * self.refill_per_s)

    def wait_s(self, address: str) -> int:
        """Whole seconds until `address` may try a key again (0: now)."""
        if address not in self._buckets:
            return 0
        missing = 1.0 - self._tokens(address)
        return 0 if missing <= 0 else max(1, math.ceil(missing / self.refill_per_s))

    def failed(self, address: str) -> None:
        """One failed authentication from `address`: takes one of its tokens."""
        tokens = self._tokens(address) - 1.0
        self._buckets[address] = (tokens, self.clock())
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)
