"""Where an engine step's wall time goes, measured in the engine's own process: the engine's methods wrapped
with timed spans (perf_counter), each span's self time (its time less its children's) added to its part less
the time the thread waited for a core in it (schedstat's run-queue delay, its own part), and one root span per
round of the loop, whose self time is what no wrapped call covers ("unaccounted").

`install_served(server)` wraps a running EngineServer (a round starts where the loop polls);
`install_offline(engine)` wraps an EngineCore driven by LLM.generate (a round starts at each step).
Used by serve_profile_entry.py; no production code knows about it.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

# Each wrapped callable's part; a part's time is the self time of its spans.
GEMM = "GEMMs (linears, lm_head)"
ATTENTION = "attention (paged, with its metadata)"
GATHERS = "gathers (index_select, embedding)"
NORMS = "RMSNorm"
ROTARY = "rotary"
NATIVE_LAYERS = "decoder layers in one native call (decode steps)"
MODEL_REST = "model: Python and element-wise ops"
SAMPLING = "sampling"
RUNNER_INPUTS = "model runner: step inputs"
SCHEDULER = "scheduler and engine core"
ZMQ_IN = "zmq in (poll, control messages)"
KV_IN = "KV link in"
ZMQ_OUT = "zmq out (token deltas)"
YIELD = "yield to zmq's I/O thread"
LOOP_OTHER = "engine loop (stats, progress)"
WAIT = "waiting for a core (run-queue delay)"
UNACCOUNTED = "unaccounted (loop glue)"

# Parts that may not claim a nested span for themselves: inside sampling, a gather is sampling's.
_OWNS_CHILDREN = {SAMPLING}


def _read_schedstat(fd: int) -> tuple[int, int]:
    """(ns on a core, ns waiting for one) of the thread whose schedstat `fd` is."""
    on_cpu, waiting, _ = os.pread(fd, 128, 0).split()
    return int(on_cpu), int(waiting)


@dataclass
class Round:
    """One round of the loop: its wall time, each part's self time, and the step it ran (if any)."""
    wall_s: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    num_decodes: int = 0
    num_tokens: int = 0
    on_cpu_ns: int = 0
    wait_ns: int = 0

    def as_dict(self) -> dict:
        return {"wall_ms": self.wall_s * 1e3, "num_decodes": self.num_decodes, "num_tokens": self.num_tokens,
                "on_cpu_ms": self.on_cpu_ns / 1e6, "wait_ms": self.wait_ns / 1e6,
                "parts_ms": {name: seconds * 1e3 for name, seconds in self.parts.items()}}


class StepClock:
    """A stack of open spans on the main thread; the rounds closed while recording. Each span's self time is
    split in two: the time its thread waited for a core (schedstat's run-queue delay, read at the span's ends)
    goes to WAIT, the rest to the span's part."""

    def __init__(self) -> None:
        self.main_thread = threading.get_ident()
        self.recording = False
        self.rounds: list[Round] = []
        self._stack: list[list] = []  # [part, start s, children's s, wait at start ns, children's wait ns]
        self._round: Round | None = None
        self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        self._sched_at_start = (0, 0)

    @property
    def round_open(self) -> bool:
        return self._round is not None

    def _span(self, part: str) -> list:
        return [part, time.perf_counter(), 0.0, _read_schedstat(self._schedstat)[1], 0]

    def enter(self, part: str) -> None:
        if self._stack and self._stack[-1][0] in _OWNS_CHILDREN:
            part = self._stack[-1][0]
        self._stack.append(self._span(part))

    def exit(self) -> float:
        """Close the innermost span: its self time to its part and WAIT, its whole time (returned) to its
        parent's children."""
        part, start, children, wait_start, children_wait = self._stack.pop()
        duration, waited = time.perf_counter() - start, _read_schedstat(self._schedstat)[1] - wait_start
        if self._round is not None:
            self._round.parts[part] += (duration - children) - (waited - children_wait) / 1e9
            self._round.parts[WAIT] += (waited - children_wait) / 1e9
        if self._stack:
            self._stack[-1][2] += duration
            self._stack[-1][4] += waited
        return duration

    def note_plan(self, plan) -> None:
        if self._round is not None and not plan.is_empty:
            self._round.num_decodes += plan.num_decodes
            self._round.num_tokens += plan.num_tokens

    def boundary(self) -> None:
        """The end of one round and the start of the next (only while recording)."""
        if self._round is not None:
            self._close_round()
        if self.recording:
            self._round = Round()
            self._sched_at_start = _read_schedstat(self._schedstat)
            self._stack = [self._span(UNACCOUNTED)]

    def _close_round(self) -> None:
        """The root span's self time is what no wrapped call covered (less its wait for a core)."""
        round_ = self._round
        self._stack = self._stack[:1]
        round_.wall_s = self.exit()
        on_cpu, waiting = _read_schedstat(self._schedstat)
        round_.on_cpu_ns, round_.wait_ns = on_cpu - self._sched_at_start[0], waiting - self._sched_at_start[1]
        if round_.num_tokens:
            self.rounds.append(round_)
        self._round = None


def timed(clock: StepClock, part: str, function):
    """`function` with its calls on the main thread, while a round is open, timed as `part`."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not clock.round_open or threading.get_ident() != clock.main_thread:
            return function(*args, **kwargs)
        clock.enter(part)
        try:
            return function(*args, **kwargs)
        finally:
            clock.exit()
    return wrapper


def wrap_method(clock: StepClock, owner: type, name: str, part: str) -> None:
    """owner.name timed as `part`; a name the class lacks is an error naming it (the engine changed)."""
    original = getattr(owner, name, None)
    if original is None:
        raise RuntimeError(f"{owner.__module__}.{owner.__qualname__} has no {name}: update experiments/step_spans.py")
    setattr(owner, name, timed(clock, part, original))


def wrap_model(clock: StepClock, runner) -> None:
    """The model runner's pieces: inputs, forward, sampling, and the model's layers by kind."""
    import torch

    from pdserve.engine.layers.linear import Linear
    from pdserve.engine.layers.norm import RMSNorm
    from pdserve.engine.layers.rotary import RotaryEmbedding
    from pdserve.engine.models.cpu_decode_layers import NativeDecodeStep

    runner_type = type(runner)
    wrap_method(clock, runner_type, "prepare", RUNNER_INPUTS)
    wrap_method(clock, runner_type, "step_logits", MODEL_REST)
    wrap_method(clock, type(runner.sampler), "__call__", SAMPLING)
    wrap_method(clock, type(runner.attn_backend), "prepare", ATTENTION)
    wrap_method(clock, type(runner.attn_backend), "forward", ATTENTION)
    wrap_method(clock, Linear, "forward", GEMM)
    wrap_method(clock, RMSNorm, "forward", NORMS)
    wrap_method(clock, RotaryEmbedding, "forward", ROTARY)
    wrap_method(clock, NativeDecodeStep, "__call__", NATIVE_LAYERS)
    for rotation in _rotation_types():
        wrap_method(clock, rotation, "__call__", ROTARY)
    wrap_method(clock, torch.nn.Embedding, "forward", GATHERS)
    wrap_method(clock, torch.Tensor, "index_select", GATHERS)


def _rotation_types() -> list[type]:
    from pdserve.engine.layers import rotary

    return [getattr(rotary, name) for name in ("TableRotation", "KernelRotation") if hasattr(rotary, name)]


def wrap_engine(clock: StepClock, engine) -> None:
    """The engine core's step and its scheduler (which also tells the clock what each step ran)."""
    wrap_method(clock, type(engine), "step", SCHEDULER)
    scheduler_type = type(engine.scheduler)
    wrap_method(clock, scheduler_type, "update_from_output", SCHEDULER)
    schedule = scheduler_type.schedule

    def schedule_noted(self):
        plan = schedule(self)
        clock.note_plan(plan)
        return plan
    scheduler_type.schedule = timed(clock, SCHEDULER, schedule_noted)
    wrap_model(clock, engine.runner)


def install_served(clock: StepClock, server) -> None:
    """Time a running EngineServer's loop: rounds start where it polls its sockets."""
    import zmq

    from pdserve.control import engine_server

    wrap_engine(clock, server.engine)
    server_type = type(server)
    for name, part in (("publish", ZMQ_OUT), ("stats", LOOP_OTHER), ("_mark_progress", LOOP_OTHER)):
        wrap_method(clock, server_type, name, part)
    guarded = server_type._guarded

    def guarded_timed(handler) -> None:
        part = ZMQ_IN if getattr(handler, "__name__", "") == "_drain_control" else KV_IN
        timed(clock, part, guarded)(handler)
    server_type._guarded = staticmethod(guarded_timed)
    zmq.Poller.poll = timed(clock, ZMQ_IN, zmq.Poller.poll)
    engine_server.let_zmq_send = timed(clock, YIELD, engine_server.let_zmq_send)
    poll_these = engine_server._poll_these

    def round_start(*args) -> None:
        clock.boundary()
        poll_these(*args)
    engine_server._poll_these = round_start


def install_offline(clock: StepClock, engine) -> None:
    """Time an EngineCore driven by LLM.generate: each step starts a round."""
    wrap_engine(clock, engine)
    step = type(engine).step

    def step_round(self):
        clock.boundary()
        return step(self)
    type(engine).step = step_round


def thread_times() -> dict[str, dict[str, float]]:
    """This process's threads by name: ms on a core and ms waiting for one, summed over threads of a name."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"on_cpu_ms": 0.0, "wait_ms": 0.0, "threads": 0})
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm, open(f"/proc/self/task/{tid}/schedstat") as stat:
                name, (on_cpu, waiting, _) = comm.read().strip(), stat.read().split()
        except OSError:  # the thread ended
            continue
        entry = totals["main" if int(tid) == os.getpid() else name]
        entry["on_cpu_ms"] += int(on_cpu) / 1e6
        entry["wait_ms"] += int(waiting) / 1e6
        entry["threads"] += 1
    return dict(totals)
