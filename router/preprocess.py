"""Chat-template rendering and tokenization off the event loop: a small thread pool, a time limit
per job, and a bounded wait for a thread.

A job starts only when a thread is free (the pool never queues work of its own), so its time limit
counts its own running time, never the time spent waiting behind others. A burst of requests waits
for threads, as vLLM's and SGLang's servers wait for their tokenizers. A thread cannot be killed: a
job over its limit is answered at once (400) but keeps its thread until it ends. Only when every
thread stays taken for QUEUE_WAIT_FACTOR time limits, which runaway jobs cause and a burst of
ordinary ones does not, does a waiting request get a 503 instead of waiting on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from pdserve.router.errors import InvalidRequest, PreprocessingBusy

T = TypeVar("T")
QUEUE_WAIT_FACTOR = 6  # a request waits up to 6 x --preprocess-timeout for a tokenizer thread (30 s by default)


class PreprocessTimeout(InvalidRequest):
    code = "preprocessing_timeout"


class Preprocessor:
    def __init__(self, num_threads: int, timeout_s: float, max_waiting: int) -> None:
        self.timeout_s = timeout_s
        self.queue_timeout_s = QUEUE_WAIT_FACTOR * timeout_s
        self.num_threads = num_threads
        self.max_waiting = max_waiting  # requests waiting for a thread (each holds its body): more get a 503 at once
        self.num_waiting = 0
        self.num_running = 0  # jobs holding a thread, abandoned ones included
        self._abandoned: set[Future] = set()  # jobs answered 400 past their time limit, still holding a thread
        self._free = asyncio.Semaphore(num_threads)  # bound to the serving loop at its first wait
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="pdserve-preprocess")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a pool thread once one is free; its exceptions (400s) propagate; over the time
        limit: 400; no thread free for queue_timeout_s: 503."""
        await self._wait_for_thread()
        loop = asyncio.get_running_loop()
        self.num_running += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(lambda done: self._release_from_thread(loop, done))
        try:
            async with asyncio.timeout(self.timeout_s):  # no extra task, unlike wait_for
                return await asyncio.wrap_future(future)
        except TimeoutError:
            if not future.done():
                self._abandoned.add(future)
            raise PreprocessTimeout(
                f"rendering the chat template and tokenizing this request took longer than the server's limit "
                f"of {self.timeout_s:g}s: send a shorter prompt or simpler template variables (operators: "
                f"--preprocess-timeout)") from None

    async def _wait_for_thread(self) -> None:
        if self.num_waiting >= self.max_waiting:
            raise PreprocessingBusy(f"{self.num_waiting} requests are already waiting for the {self.num_threads} "
                                    "tokenizer threads: retry later")
        self.num_waiting += 1
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await self._free.acquire()
        except TimeoutError:
            raise PreprocessingBusy(
                f"all {self.num_threads} tokenizer threads stayed busy for {self.queue_timeout_s:g}s with requests "
                "still being rendered or tokenized: retry later") from None
        finally:
            self.num_waiting -= 1

    @property
    def stuck(self) -> bool:
        """Every thread is held by a job past its time limit: no request can be tokenized until one ends."""
        return len(self._abandoned) >= self.num_threads

    def _release_from_thread(self, loop: asyncio.AbstractEventLoop, future: Future) -> None:
        try:
            loop.call_soon_threadsafe(self._release, future)
        except RuntimeError:  # the loop has closed: the server is shutting down
            pass

    def _release(self, future: Future) -> None:
        self._abandoned.discard(future)
        self.num_running -= 1
        self._free.release()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
