"""A budget for the bytes of request bodies being parsed and served at once: the parsed JSON, models and
token ids of a body take many times its size, so a burst of large bodies is what grows the router's
memory. A request reserves its Content-Length (or the body cap, `undeclared_bytes`, when it sends none) before its body is
read, and gives it back when its handler returns (for a stream: once it is set up). A request that finds
no room waits up to `wait_s`, then gets a 503 with Retry-After.

    async with budget.holding(num_bytes):
        ...read, parse, preprocess, submit...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pdserve.router.errors import APIError


class BodyBudgetFull(APIError):
    status_code, code = 503, "server_busy"
    retry_after_s = 1


class BodyBudget:
    def __init__(self, capacity: int, wait_s: float, undeclared_bytes: int) -> None:
        self.capacity, self.wait_s = capacity, wait_s
        self.undeclared_bytes = undeclared_bytes  # reserved for a body sent without Content-Length (chunked)
        self.used = 0
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
