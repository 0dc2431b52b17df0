"""Run a kernel call at several torch thread counts, for the tests that its bytes do not depend on them."""

from __future__ import annotations

from collections.abc import Callable

import torch


def at_thread_counts(call: Callable[[], torch.Tensor], counts: tuple[int, ...] = (1, 2, 3)) -> list[torch.Tensor]:
    """call() once at each thread count, in order; torch's thread count is restored afterwards."""
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(call())
        return results
    finally:
        torch.set_num_threads(previous)
