"""A served engine for `pdserve profile`: one `pdserve decode` process (CURVE on its control socket, one thread,
pinned to one core, as `pdserve up --pin-cpus` starts it) driven over its control socket, as the router drives
it. Decode points: the process's CPU time per decode step (all its threads: the engine loop, ZeroMQ's I/O with
its encryption, heartbeats) and the median gap between a request's tokens; the in-process steps of
planner/profile/measure.py miss the first. The reference: a 1,000-token prompt alone, its CPU and wall time, to
compare with a sweep's unloaded TTFT (the machine's speed drifts during the day)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pdserve.planner.profile.fit import DecodePoint

SERVED_TOKENS = 16  # tokens per request: the decode steps timed after the prompts are in (15 steps, 1-6 s of CPU)


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has run, all its threads (exited ones too), to the nanosecond: Linux's CPU clock of
    that process (clock_getcpuclockid). /proc/PID/stat counts whole 10 ms ticks, which reads 0 for the 15 steps of
    a small model's decode point."""
    process_clock = ((~pid) << 3) | 2  # the kernel's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    try:
        return time.clock_gettime(process_clock)
    except OSError:  # no such clock here: whole ticks
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


REFERENCE_PROMPT_LEN = 1000  # the sweeps' prefill-heavy prompt
REFERENCE_REPEATS = 3


@contextlib.contextmanager
def served_engine(model: str, core: int, max_num_batched_tokens: int, dtype: str = "float32") -> Iterator[tuple]:
    """(driver, pid, prompts) of a `pdserve decode` process pinned to `core` with OMP_NUM_THREADS=1, computing in
    `dtype`."""
    from pdserve.control.keys import load_cluster_keys, write_cluster_keys
    from pdserve.local_cluster import Driver, EngineProcess

    work = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
    write_cluster_keys(work / "keys")
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # the engine process inherits the one core
    try:
        engine = EngineProcess("decode", model, "--max-num-batched-tokens", str(max_num_batched_tokens),
                               "--dtype", dtype, "--curve-dir", str(work / "keys"), env={"OMP_NUM_THREADS": "1"},
                               log_dir=work)
    finally:
        os.sched_setaffinity(0, allowed)
    driver = Driver(engine, curve=load_cluster_keys(work / "keys").client)
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    try:
        yield driver, engine.process.pid, _Prompts(np.random.default_rng(1), vocab_size)
    finally:
        driver.close()
        engine.stop()


def served_decode_points(session: tuple, shapes: list[tuple[int, int]], warm_up: bool = True) -> list[DecodePoint]:
    """One point per (batch, prompt length): CPU and wall time per decode step of the served engine (after a
    warm-up point, not returned, unless warm_up is False)."""
    driver, pid, prompts = session
    warm = [(1, 16)] if warm_up else []
    points = [_point(driver, pid, batch, prompt_len, prompts, f"{batch}x{prompt_len}-{next(_tags)}")
              for batch, prompt_len in [*warm, *shapes]]
    return points[len(warm):]


def served_decode_passes(session: tuple, shapes: list[tuple[int, int]], passes: int) -> list[DecodePoint]:
    """Each shape timed `passes` times, every other pass in reverse order, and each shape's median point: a slow
    stretch of the machine (minutes, on a shared host) that falls on one pass moves no shape, where fitting every
    pass would move the plane by its share. Later passes find their prompts in the prefix cache and cost their
    decode steps."""
    runs = [served_decode_points(session, shapes[::-1] if n % 2 else shapes, warm_up=n == 0) for n in range(passes)]
    in_order = [run[::-1] if n % 2 else run for n, run in enumerate(runs)]
    return [median_point(timings) for timings in zip(*in_order, strict=True)]


def median_point(timings: tuple[DecodePoint, ...]) -> DecodePoint:
    """One shape's timings (same batch and context) as one point: the median wall and CPU seconds per step."""
    return timings[0].model_copy(update={"seconds": statistics.median(t.seconds for t in timings),
                                         "cpu_seconds": statistics.median(t.cpu_seconds for t in timings)})


def served_prefill_reference(session: tuple, prompt_len: int, repeats: int = REFERENCE_REPEATS) -> dict:
    """Median CPU and wall seconds of one prompt alone (max_tokens=1) through the served engine."""
    driver, pid, prompts = session
    driver.generate([prompts.new(16)], remote=False, prefix="reference-warmup", temperature=0.0, max_tokens=1)
    cpu, wall = [], []
    for n in range(repeats):
        before_cpu, before = process_cpu_s(pid), time.perf_counter()
        driver.generate([prompts.new(prompt_len)], remote=False, prefix=f"reference-{n}-", temperature=0.0,
                        max_tokens=1, ignore_eos=True)
        wall.append(time.perf_counter() - before)
        cpu.append(process_cpu_s(pid) - before_cpu)
    return {"prompt_len": prompt_len, "served_prefill_cpu_s": statistics.median(cpu),
            "served_prefill_wall_s": statistics.median(wall), "repeats": repeats}


_tags = itertools.count()  # request ids unique across calls on one engine


class _Prompts:
    """The served engine's prompts. `new`: tokens it has never seen (the reference prefill). `prefix(i, length)`: the
    first `length` tokens of base sequence i, the same every time. A decode point's batch takes bases 0..batch-1, so
    its sequences differ from their first token (each reads KV of its own), while a repeat, a co-run pass or a longer
    prompt of the same base finds what came before in the engine's prefix cache and computes only the rest: the
    profile times the decode steps, not the prompts before them. `cached_tokens`: prompt tokens the engine reported
    found in its cache."""

    def __init__(self, rng: np.random.Generator, vocab_size: int) -> None:
        self.rng, self.vocab_size = rng, vocab_size
        self.bases: list[list[int]] = []
        self.cached_tokens = 0

    def new(self, length: int) -> list[int]:
        return self.rng.integers(min(10, self.vocab_size - 1), self.vocab_size, size=length).tolist()

    def prefix(self, index: int, length: int) -> list[int]:
        while len(self.bases) <= index:
            self.bases.append([])
        base = self.bases[index]
        if len(base) < length:
            base.extend(self.new(length - len(base)))
        return base[:length]


def _point(driver, pid: int, batch: int, prompt_len: int, prompts: _Prompts, tag: str) -> DecodePoint:
    from pdserve.control.messages import TokenDelta

    ids = [f"{tag}-{i}" for i in range(batch)]
    for index, request_id in enumerate(ids):
        driver.submit(request_id, prompts.prefix(index, prompt_len), remote=False,
                      temperature=0.0, max_tokens=SERVED_TOKENS, ignore_eos=True)
    times: dict[str, list[float]] = {request_id: [] for request_id in ids}
    cpu_at_first = None
    finished = 0
    while finished < batch:
        received = driver.decode.recv(timeout=0.01)
        if received is None or not isinstance(received.msg, TokenDelta):
            continue
        if received.msg.token_ids:
            if not times[received.msg.request_id]:
                prompts.cached_tokens += received.msg.num_cached_tokens
            times[received.msg.request_id].append(time.perf_counter())
            if cpu_at_first is None and all(times.values()):
                cpu_at_first = process_cpu_s(pid)  # every prompt is in: decode steps from here
        if received.msg.error:
            raise RuntimeError(f"the served engine failed {received.msg.request_id}: {received.msg.error}")
        finished += received.msg.finish_reason is not None
    num_steps = SERVED_TOKENS - 1
    cpu_per_step = (process_cpu_s(pid) - cpu_at_first) / num_steps
    gaps = [b - a for stamps in times.values() for a, b in itertools.pairwise(stamps[1:])]  # after the first token
    context = prompt_len + SERVED_TOKENS // 2  # each sequence's, mid-way through the timed steps
    return DecodePoint(batch=batch, context=batch * context, longest=context, seconds=statistics.median(gaps),
                       cpu_seconds=cpu_per_step)
