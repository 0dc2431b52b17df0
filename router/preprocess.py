"""Chat-template rendering and tokenization off the event loop: a small thread pool, a time limit
per job, and a bound on the jobs it holds. A thread cannot be killed, so a job over the limit is
answered at once but keeps its thread (and counts against the bound) until it ends: runaway renders
fill the pool, and then new work gets a 503 instead of piling up."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from pdserve.router.errors import InvalidRequest, PreprocessingBusy

T = TypeVar("T")


class PreprocessTimeout(InvalidRequest):
    code = "preprocessing_timeout"


class Preprocessor:
    def __init__(self, num_threads: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.max_jobs = 2 * num_threads  # running + queued, abandoned ones included
        self.num_jobs = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="pdserve-preprocess")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a pool thread; its exceptions (400s) propagate; over the time limit: 400."""
        with self._lock:
            if self.num_jobs >= self.max_jobs:
                raise PreprocessingBusy(f"all {self.max_jobs} tokenizer slots are taken by requests still being "
                                        "rendered or tokenized: retry later")
            self.num_jobs += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(self._finished)
        try:
            async with asyncio.timeout(self.timeout_s):  # no extra task, unlike wait_for
                return await asyncio.wrap_future(future)
        except TimeoutError:
            raise PreprocessTimeout(
                f"rendering the chat template and tokenizing this request took longer than the server's limit "
                f"of {self.timeout_s:g}s: send a shorter prompt or simpler template variables (operators: "
                f"--preprocess-timeout)") from None

    def _finished(self, _: Future) -> None:
        with self._lock:
            self.num_jobs -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
