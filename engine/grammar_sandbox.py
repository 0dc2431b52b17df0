"""Structured-output constraints compiled first in worker processes (engine/grammar_worker.py), so a
compiler crash, a runaway allocation or an endless compile ends a worker and fails one request, never
the router or an engine. A small pool of workers, each one job at a time, replaced when it dies;
verdicts cached by the constraint's hash. Blocking calls: the router calls it from a preprocessing
thread, an engine before its own compile."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.engine.grammar_worker import frame

log = logging.getLogger("pdserve.grammar")

_LENGTH_BYTES = 4
_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "grammar": "Lark grammar", "choice": "choice list"}


@dataclass(frozen=True)
class SandboxConfig:
    num_workers: int = 2
    timeout_s: float = 4.0  # one check's wall time (the router's preprocessing limit is 5 s by default)
    start_timeout_s: float = 60.0  # a new worker's imports, before its first check
    cpu_s: int = 4  # one check's CPU time
    memory_bytes: int = 2 << 30  # each worker's address space
    # The compiling thread's stack: a quarter of the usual 8 MiB, so a constraint the worker compiles also
    # compiles on any thread of the router or an engine
    stack_bytes: int = 2 << 20
    cache_size: int = 4096  # verdicts kept


class WorkerDied(Exception):
    """The worker ended (crashed, or was killed past a limit) while it checked a constraint. `lasting`:
    whether the same constraint would do it again (a wall-clock timeout may be the machine's load)."""

    def __init__(self, reason: str, lasting: bool = True, fix: str = "send a smaller, simpler constraint") -> None:
        super().__init__(reason)
        self.lasting = lasting
        self.fix = fix


class _Worker:
    """One worker process speaking grammar_worker's frames; `command` runs another worker module on the same
    frames (router/template_sandbox.py's)."""

    def __init__(self, config: SandboxConfig, command: list[str] | None = None) -> None:
        self.config = config
        self.process = subprocess.Popen(
            command or [sys.executable, "-m", "pdserve.engine.grammar_worker", str(config.memory_bytes),
                        str(config.cpu_s), str(config.stack_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ready = False  # its ready frame read

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def check(self, kind: str, spec: str) -> str | None:
        """The compiler's problem with the constraint, or None; WorkerDied when the worker ends or passes
        the time limit (it is then killed)."""
        if not self.ready:
            try:
                self._read_frame(self.config.start_timeout_s, "to start")
            except WorkerDied as exc:  # not the constraint's doing: not kept
                log.warning("grammar check worker %d did not start: it %s", self.pid, exc)
                raise WorkerDied("could not be checked: the grammar checker process did not start", lasting=False,
                                 fix="retry later (operators: the server's log says why)") from None
            self.ready = True
        try:
            self.process.stdin.write(frame({"kind": kind, "spec": spec}))
            self.process.stdin.flush()
        except OSError as exc:  # BrokenPipeError: it had died
            raise WorkerDied(self._death()) from exc
        return self._read_frame(self.config.timeout_s, "to compile")["problem"]

    def _read_frame(self, timeout_s: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout_s
        head = self._read(_LENGTH_BYTES, deadline, timeout_s, doing)
        return json.loads(self._read(int.from_bytes(head, "big"), deadline, timeout_s, doing))

    def _read(self, size: int, deadline: float, timeout_s: float, doing: str) -> bytes:
        fd, data = self.process.stdout.fileno(), b""
        readable = select.poll()  # not select(): a router may hold more than 1,024 descriptors
        readable.register(fd, select.POLLIN)
        while len(data) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not readable.poll(remaining * 1000):
                self.kill()
                raise WorkerDied(f"took longer than {timeout_s:g}s {doing}", lasting=False)
            chunk = os.read(fd, size - len(data))
            if not chunk:
                raise WorkerDied(self._death())
            data += chunk
        return data

    def _death(self) -> str:
        code = self.process.wait()
        if code < 0 and -code == signal.SIGXCPU:
            return f"took more than {self.config.cpu_s}s of CPU to compile"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"crashed the grammar compiler ({name})"
        return f"ended the grammar compiler (exit status {code})"

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()


class GrammarSandbox:
    """check(kind, spec) -> the compiler's problem with a constraint (None: it compiles), run in a worker."""

    def __init__(self, config: SandboxConfig = SandboxConfig()) -> None:
        self.config = config
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()  # the warmest worker first: a second
        # one starts only when two checks overlap
        for _ in range(config.num_workers):
            self._idle.put(None)  # a slot: its worker starts on first use
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._lock = threading.Lock()
        self.num_checks = 0  # checks run in a worker (a cached verdict runs none)
        self.num_worker_deaths = 0

    def cached(self, kind: str, spec: str) -> bool:
        with self._lock:
            return _key(kind, spec) in self._verdicts

    def check(self, kind: str, spec: str) -> str | None:
        key = _key(kind, spec)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        problem, lasting = self._run(kind, spec)
        if lasting:
            with self._lock:
                self._verdicts[key] = problem
                if len(self._verdicts) > self.config.cache_size:
                    self._verdicts.popitem(last=False)
        return problem

    def _run(self, kind: str, spec: str) -> tuple[str | None, bool]:
        """(problem, whether the verdict lasts: a timeout may be the machine's load, so it is not kept). A
        worker that dies is replaced and the constraint tried once more on the new one (it may have died of
        something else, killed while idle); a second death is the verdict."""
        try:
            return self._run_once(kind, spec), True
        except WorkerDied as exc:
            if not exc.lasting:
                return self._died(kind, exc), False
        try:
            return self._run_once(kind, spec), True
        except WorkerDied as exc:
            return self._died(kind, exc), exc.lasting

    def _run_once(self, kind: str, spec: str) -> str | None:
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive():
                worker = _Worker(self.config)
            self.num_checks += 1
            return worker.check(kind, spec)
        except WorkerDied as exc:
            self.num_worker_deaths += 1
            log.warning("grammar check worker %d died checking a %s of %d characters: it %s; starting another",
                        worker.pid, kind, len(spec), exc)
            worker.kill()
            worker = None
            raise
        finally:
            self._idle.put(worker)

    @staticmethod
    def _died(kind: str, exc: WorkerDied) -> str:
        return f"the structured output's {_KIND_NAMES.get(kind, kind)} {exc}: {exc.fix}"

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (tests kill one)."""
        with self._idle.mutex:
            return [worker.pid for worker in self._idle.queue if worker is not None and worker.alive()]

    def close(self) -> None:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


def _key(kind: str, spec: str) -> bytes:
    return hashlib.sha256(kind.encode() + b"\0" + spec.encode("utf-8", "surrogatepass")).digest()


_shared: GrammarSandbox | None = None
_shared_lock = threading.Lock()


def shared_sandbox() -> GrammarSandbox:
    """This process's sandbox, made on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = GrammarSandbox()
        return _shared
