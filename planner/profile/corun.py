"""`pdserve profile`'s co-run step (CPU, two cores or more): the served engine's decode steps timed alone, then
while a second process pinned to another core works with the same model in a loop, alternated a few times. That
process either computes prompts, or runs decode steps of a batch that keeps going (one process of each kind, one
working at a time). The medians of each round's ratios (co-run over alone, seconds apart) give the profile's
decode_corun_factor (machine["decode_corun"]["factor"]) and its decode_beside_decode_factor
(machine["decode_corun"]["beside_decode"]["factor"]): how much slower a decode step is while another engine of the
host computes a prefill, or decodes (docs/benchmarking/plan.md)."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Iterator

from pdserve.planner.profile.served import SERVED_TOKENS, served_decode_points

# (batch, prompt length) of the decode steps timed: batch 1 and a mid batch over short contexts (mostly weights), and
# a batch over long contexts (a third of its step reads KV): corun_fit.py splits the factor between the two
CORUN_SHAPES = [(1, 16), (8, 16), (2, 1000)]
CORUN_REPEATS = 4  # alone / co-run rounds, paired
QUICK_CORUN_SHAPES = [(1, 16), (2, 16)]
LOOP_START_S = 120.0  # the other process's start (torch import, model load) and its first prompt
PAUSE_S = 30.0  # the longest a prompt under way may take to finish when the loop is paused
PREFILL, DECODE = "prefill", "decode"  # what the other process does in its loop
DECODE_LOOP_BATCH, DECODE_LOOP_PROMPT, DECODE_LOOP_TOKENS = 8, 64, 256  # its batch, renewed as it finishes


def fitting_shapes(shapes: list[tuple[int, int]], max_len: int) -> list[tuple[int, int]]:
    """The shapes with each prompt cut to what the model's context holds with the timed tokens after it."""
    longest = max_len - SERVED_TOKENS - 1
    return [(batch, min(prompt_len, longest)) for batch, prompt_len in shapes]


def other_core(core: int, allowed: set[int]) -> int | None:
    """A core for the prefill loop other than the served engine's, or None (one core: nothing to co-run)."""
    others = sorted(set(allowed) - {core})
    return others[0] if others else None


def measure_decode_corun(session: tuple, model: str, core: int, max_num_batched_tokens: int, prompt_len: int,
                         shapes: list[tuple[int, int]], repeats: int, kinds: tuple[str, ...] = (PREFILL, DECODE),
                         dtype: str = "float32") -> dict[str, dict]:
    """The served engine's decode steps per shape, alone and beside each kind of neighbour on `core` (PREFILL: prompts
    computed there; DECODE: decode steps run there), per kind: each side's median CPU and wall seconds per step,
    the median of the rounds' paired ratios, the batch and the context tokens it attends, and the factor (the mean of
    the shapes' CPU ratios: the profile's clock on CPU; corun_fit.py splits it between the step's weights part
    and its KV reads).

    One process per kind starts at once; each round times the steps alone and beside each neighbour in turn (the
    others idle; the order reversed every other round), so every kind is compared with the same alone passes."""
    started = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "load_average": list(os.getloadavg())}
    keys = [f"{batch}x{prompt}" for batch, prompt in shapes]
    sides: dict[str | None, dict[str, list]] = {side: {key: [] for key in keys} for side in (None, *kinds)}
    with contextlib.ExitStack() as stack:
        loops = {kind: stack.enter_context(busy_loop(kind, model, core, max_num_batched_tokens, prompt_len, dtype))
                 for kind in kinds}
        for loop in loops.values():
            loop.wait_ready()
        for round_index in range(repeats):
            for side in round_order([None, *kinds], round_index):
                for kind, loop in loops.items():
                    loop.run(kind == side)
                for key, point in zip(keys, served_decode_points(session, shapes, warm_up=False), strict=True):
                    sides[side][key].append(point)
                for kind, loop in loops.items():
                    loop.check_working(kind == side)  # all along: a loop that died after it started measured nothing
    return {kind: {**paired_ratios(sides[None], sides[kind]), **_loop_shape(kind, prompt_len), f"{kind}_core": core,
                   "repeats": repeats, **started} for kind in kinds}


def round_order(sides: list, round_index: int) -> list:
    """The sides of one round: in order on even rounds, reversed on odd ones, so that a machine speeding up or
    slowing down over the rounds (it drifts by 10-20% over minutes here) favours no side."""
    return sides if round_index % 2 == 0 else sides[::-1]


def paired_ratios(alone: dict[str, list], corun: dict[str, list]) -> dict:
    """Per shape: the median alone and co-run seconds per step on each clock, and each clock's ratio as the median of
    the rounds' own ratios (co-run over the alone pass of the same round, seconds apart), which the machine's drift
    between rounds leaves alone; the ratio of the two medians would carry it. The factor: the shapes' mean CPU
    ratio."""
    batches = {}
    for key, alone_points in alone.items():
        row = {"batch": alone_points[0].batch, "context": alone_points[0].context}
        for clock, field in (("cpu", "cpu_seconds"), ("wall", "seconds")):
            alone_s = [getattr(point, field) for point in alone_points]  # (rounds,)
            corun_s = [getattr(point, field) for point in corun[key]]
            rounds = [after / before for before, after in zip(alone_s, corun_s, strict=True)]
            row |= {f"alone_{clock}_s": statistics.median(alone_s), f"corun_{clock}_s": statistics.median(corun_s),
                    f"{clock}_ratio": statistics.median(rounds), f"{clock}_round_ratios": rounds}
        batches[key] = row
    return {"factor": statistics.fmean(row["cpu_ratio"] for row in batches.values()), "clock": "cpu",
            "batches": batches}


def _loop_shape(kind: str, prompt_len: int) -> dict:
    if kind == PREFILL:
        return {"prefill_prompt_len": prompt_len}
    return {"decode_batch": DECODE_LOOP_BATCH, "decode_prompt_len": DECODE_LOOP_PROMPT,
            "decode_tokens": DECODE_LOOP_TOKENS}


class BusyLoop:
    """The other process's switch: run(True) returns once it works, run(False) once it is idle."""

    def __init__(self, go, busy, ready, process) -> None:
        self.go, self.busy, self.ready, self.process = go, busy, ready, process

    def wait_ready(self) -> None:
        """Returns once the process has loaded the model and warmed up: until then it loads on its core, and steps
        timed "alone" would not be."""
        deadline = time.monotonic() + LOOP_START_S
        while not self.ready.wait(0.1):
            self.check_working(False)
            if time.monotonic() > deadline:
                raise RuntimeError("the co-run process did not load the model in time: run `pdserve profile` on a "
                                   "quieter machine, or skip the step with --no-corun")

    def run(self, running: bool) -> None:
        (self.go.set if running else self.go.clear)()
        deadline = time.monotonic() + (LOOP_START_S if running else PAUSE_S)
        while self.busy.is_set() != running:
            self.check_working(False)
            if time.monotonic() > deadline:
                raise RuntimeError("the co-run process did not answer in time: run `pdserve profile` on a "
                                   "quieter machine, or skip the step with --no-corun")
            time.sleep(0.02)

    def check_working(self, running: bool) -> None:
        """Raises if the process exited, or (running) if it stopped working."""
        if not self.process.is_alive() or (running and not self.busy.is_set()):
            raise RuntimeError(f"the co-run process stopped (exit code {self.process.exitcode}); its error is above")


@contextlib.contextmanager
def busy_loop(kind: str, model: str, core: int, max_num_batched_tokens: int, prompt_len: int,
              dtype: str = "float32") -> Iterator[BusyLoop]:
    ctx = mp.get_context("spawn")
    go, busy, ready, stop = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    process = ctx.Process(target=_work, args=(kind, model, core, max_num_batched_tokens, prompt_len, dtype, go, busy,
                                              ready, stop),
                          name=f"corun-{kind}", daemon=True)
    process.start()
    try:
        yield BusyLoop(go, busy, ready, process)
    finally:
        stop.set()
        go.set()  # wakes it if idle
        process.join(PAUSE_S)
        if process.is_alive():
            process.kill()
            process.join()


def _work(kind: str, model: str, core: int, max_num_batched_tokens: int, prompt_len: int, dtype: str, go, busy,
          ready, stop) -> None:
    """In the other process, pinned to `core` with one thread, while `go` is set: PREFILL, fresh prompts of
    prompt_len one after another; DECODE, steps of a batch of DECODE_LOOP_BATCH requests, each one replaced by a
    fresh one when it finishes (its prompt takes a step of its own). `busy` says whether it works."""
    from pdserve.planner.profile.measure import EngineProbe, one_core

    with one_core(core):
        probe = EngineProbe(model, "cpu", max_num_batched_tokens, dtype)
        prompt_len = min(prompt_len, probe.llm.model_config.max_model_len - 1)
        probe.prefill_points(16, 1)  # warm-up
        ready.set()
        try:
            while not stop.is_set():
                if not go.is_set():
                    busy.clear()
                    go.wait(0.05)
                    continue
                busy.set()
                _work_once(kind, probe, prompt_len)
        finally:
            busy.clear()  # the parent's check_alive sees it stopped, before the process has finished exiting


def _work_once(kind: str, probe, prompt_len: int) -> None:
    if kind == PREFILL:
        probe.prefill_points(prompt_len, 1)
        return
    for _ in range(DECODE_LOOP_BATCH - probe.engine.scheduler.num_unfinished):
        probe.add(DECODE_LOOP_PROMPT, DECODE_LOOP_TOKENS)
    probe.engine.step()
