"""A budget for the bytes of request bodies being parsed and served at once: the parsed JSON, models and
token ids of a body take many times its size, so a burst of large bodies is what grows the router's
memory. A request reserves its Content-Length (or the body cap, `undeclared_bytes`, when it sends none) before its body is
read, and gives it back when its handler returns (for a stream: once it is set up). A request that finds
no room waits up to `wait_s`, then gets a 503 with Retry-After. When the budget goes idle after at least
`trim_after_bytes` of bodies, the heap's free memory is handed back to the OS (heap_trim.py) on a thread.

    async with budget.holding(num_bytes):
        ...read, parse, preprocess, submit...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pdserve.router.errors import APIError
from pdserve.router.heap_trim import trim_heap


TRIM_DELAY_S = 0.5


class BodyBudgetFull(APIError):
    status_code, code = 503, "server_busy"
    retry_after_s = 1


class BodyBudget:
    def __init__(self, capacity: int, wait_s: float, undeclared_bytes: int, trim_after_bytes: int = 16 << 20) -> None:
        self.capacity, self.wait_s = capacity, wait_s
        self.undeclared_bytes = undeclared_bytes  # reserved for a body sent without Content-Length (chunked)
        self.trim_after_bytes = trim_after_bytes
        self.used = 0
        self.bytes_since_trim = 0
        self.num_trims = 0
        self._freed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def holding(self, num_bytes: int) -> AsyncIterator[None]:
        num_bytes = min(num_bytes, self.capacity)  # one body larger than the whole budget waits for all of it
        await self._reserve(num_bytes)
        try:
            yield
        finally:
            async with self._freed:
                self.used -= num_bytes
                self._freed.notify_all()
            self._trim_when_idle()

    async def _reserve(self, num_bytes: int) -> None:
        async with self._freed:
            try:
                async with asyncio.timeout(self.wait_s):
                    await self._freed.wait_for(lambda: self.used + num_bytes <= self.capacity)
            except TimeoutError:
                raise BodyBudgetFull(
                    f"the server is parsing {self.used} bytes of request bodies, its limit at once is "
                    f"{self.capacity}: retry shortly (operators: RouterConfig.max_body_bytes_in_flight)") from None
            self.used += num_bytes
            self.bytes_since_trim += num_bytes

    def _trim_when_idle(self) -> None:
        """A trim shortly after the last body of a burst is let go (its answer and error frames freed too)."""
        if self.used == 0 and self.bytes_since_trim >= self.trim_after_bytes:
            asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim)

    def _trim(self) -> None:
        if self.used == 0 and self.bytes_since_trim >= self.trim_after_bytes:
            self.bytes_since_trim = 0
            self.num_trims += 1
            asyncio.get_running_loop().run_in_executor(None, trim_heap)
