"""One intra-op thread for memory-bound copies that run while another engine works on the other cores."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run the enclosed torch ops on a single intra-op thread when `device` is the CPU.

    KV transfer copies (gather from blocks on P, scatter into blocks on D) are memory bound and run
    while the peer engine is busy on the same machine's other cores. Split over every core, each copy
    waits at the end for its slowest thread, which the peer has pre-empted: on the 2-core benchmark box
    a 4.5 MiB gather took 0.3–9.7 ms that way, against ~0.4 ms on one thread. No effect on CUDA."""
    previous = torch.get_num_threads()
    if device.type != "cpu" or previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
