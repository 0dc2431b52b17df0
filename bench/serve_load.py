"""The load: each request sent at its arrival time, at most --max-concurrency in flight, until all end.

A request waits for a free slot after it arrives (vLLM bench serve's behaviour), so a concurrency cap
turns a fast arrival rate into a closed loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from pdserve.bench.serve_client import RequestShape, build_payload, send_request
from pdserve.bench.serve_datasets import SampleRequest
from pdserve.bench.serve_metrics import RequestResult


@dataclass(frozen=True)
class LoadTarget:
    url: str  # base URL + endpoint
    shape: RequestShape
    stall_timeout_s: float
    count_tokens: Callable[[str], int] | None = None


@dataclass(frozen=True)
class LoadOutcome:
    results: list[RequestResult]
    duration_s: float  # from the first send to the last end
    client_cpu_s: float  # CPU this process spent meanwhile: near duration_s, the client may be the bottleneck
    interrupted: bool = False  # Ctrl-C: results holds only the requests that had ended, duration_s runs to it
    indices: tuple[int, ...] = ()  # [len(results)] each result's place among the samples


def open_session(api_key: str | None, stall_timeout_s: float, max_concurrency: int | None) -> aiohttp.ClientSession:
    """One pooled HTTP session for the run: as many connections as requests in flight, a read timeout
    (no byte for stall_timeout_s) and no total timeout."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, limit_per_host=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=stall_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)


async def run_load(session: aiohttp.ClientSession, target: LoadTarget, samples: Sequence[SampleRequest],
                   offsets: Sequence[float], max_concurrency: int | None,
                   on_done: Callable[[RequestResult], None] = lambda result: None) -> LoadOutcome:
    """Every request's result, in sample order, and the time the load took. Cancelled (Ctrl-C), the requests in
    flight are cancelled and the outcome holds the ones that had ended, in sample order."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(sample: SampleRequest) -> RequestResult:
        async with slots if slots is not None else contextlib.nullcontext():
            result = await send_request(session, target.url, build_payload(sample, target.shape),
                                        input_len=sample.prompt_len, stall_timeout_s=target.stall_timeout_s,
                                        count_tokens=target.count_tokens)
        on_done(result)
        return result

    start, start_cpu = time.perf_counter(), time.process_time()
    tasks = []
    try:
        for sample, offset in zip(samples, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample)))
        results = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        indices = tuple(i for i, task in enumerate(tasks) if not task.cancelled())
        return LoadOutcome([tasks[i].result() for i in indices], time.perf_counter() - start,
                           time.process_time() - start_cpu, interrupted=True, indices=indices)
    return LoadOutcome(list(results), time.perf_counter() - start, time.process_time() - start_cpu,
                       indices=tuple(range(len(results))))
