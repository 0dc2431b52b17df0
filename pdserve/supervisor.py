"""`pdserve up`'s process supervision: start each component with its log file, wait for its
PDSERVE_READY line, restart one that exits or whose loop stops making progress (exponential backoff,
a bounded number of restarts per window for an engine; the router, which every client reaches, past the
bound at the longest backoff), and stop them all in order. An engine's loop touches its
progress file as it goes round; a file older than the stall bound means the loop is stuck.
Policy and bounds: docs/serving/supervision.md.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.1
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 30
MIN_FREE_LOG_BYTES = 1 << 20  # below this, a failure message says the disk of the logs is full


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # per component within window_s; 0 = never restart
    window_s: float = 600.0
    stall_s: float = 120.0  # an engine loop without progress this long is stuck; 0 = never checked
    startup_s: float = 900.0  # a restarted component must be ready within this
    backoff_s: float = 0.5  # the first restart's delay, doubled for each recent restart
    max_backoff_s: float = 30.0

    def recent(self, restart_times: list[float], now: float) -> int:
        return sum(1 for t in restart_times if now - t < self.window_s)

    def can_restart(self, restart_times: list[float], now: float) -> bool:
        return self.recent(restart_times, now) < self.max_restarts

    def keeps_restarting(self, component_name: str) -> bool:
        """Whether the component is restarted past max_restarts (at the capped backoff) rather than given up:
        the router, since nothing serves without it; never when restarts are off."""
        return component_name == "router" and self.max_restarts > 0

    def delay(self, restart_times: list[float], now: float) -> float:
        return min(self.backoff_s * 2 ** self.recent(restart_times, now), self.max_backoff_s)


@dataclass
class Component:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cpus: list[int] | None = None  # CPU affinity, when pinned
    where: str = ""  # for the progress line
    progress_path: Path | None = None  # touched by an engine's loop (--progress-file)
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    log_offset: int = 0  # where this run's lines begin in the log
    ready: dict[str, str] | None = None
    started_at: float = 0.0
    ready_wall: float = 0.0  # time.time() when it became ready (progress files carry wall-clock times)
    restart_times: list[float] = field(default_factory=list)
    restart_at: float | None = None  # a restart waiting out its backoff
    given_up: bool = False  # restarts exhausted: left out


class ComponentFailed(Exception):
    def __init__(self, component: Component, why: str) -> None:
        super().__init__(f"{component.name} {why}")
        self.component = component


def _child_setup(cpus: list[int] | None):
    """Runs in each child before exec: its CPU cores, and SIGTERM when `up` itself dies (even by SIGKILL)."""
    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # not Linux: children outlive a killed `up`
            pass
    return setup


def exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def full_disk_note(log_dir: Path) -> str:
    """A note for a failure message when the disk holding the logs is (nearly) full: a component whose log
    cannot be written dies at its first line, or cannot print the ready line `up` waits for. Else ''."""
    try:
        stat = os.statvfs(log_dir)
    except OSError:
        return ""
    free = (stat.f_bfree if os.geteuid() == 0 else stat.f_bavail) * stat.f_frsize  # root may use the reserve
    if free >= MIN_FREE_LOG_BYTES:
        return ""
    return (f" (note: the disk holding {log_dir} has {free} bytes free: a component cannot write its log there, "
            f"nor the ready line `up` waits for; free space there, or give --log-dir on another disk)")


def say(message: str, error: bool = False) -> None:
    print(f"[pdserve up] {message}", file=sys.stderr if error else sys.stdout, flush=True)


class Supervisor:
    def __init__(self, log_dir: Path, policy: RestartPolicy | None = None) -> None:
        self.log_dir = log_dir
        self.policy = policy or RestartPolicy()
        self.components: list[Component] = []
        self.stopping = False

    # ---- starting ----

    def start(self, component: Component) -> None:
        component.log_path = self.log_dir / f"{component.name}.log"
        self._spawn(component, "w")
        self.components.append(component)

    def _spawn(self, component: Component, mode: str) -> None:
        with open(component.log_path, mode) as log_file:
            if mode == "a":
                header = f"\n---- [pdserve up] restart {len(component.restart_times)} ----\n"
                try:  # unbuffered: a full disk fails this write, not the close
                    os.write(log_file.fileno(), header.encode())
                except OSError:
                    pass  # the restart goes on; if it fails for want of space, its failure says so
            component.log_offset = log_file.tell()
            component.process = subprocess.Popen(
                component.command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **component.env}, start_new_session=True,  # Ctrl-C reaches `up` only
                preexec_fn=_child_setup(component.cpus))
        component.ready = None
        component.started_at = time.monotonic()

    def check_alive(self, components: list[Component] | None = None) -> None:
        for component in self.components if components is None else components:
            code = component.process.poll()
            if code is not None:
                raise ComponentFailed(component, exit_reason(code))

    @staticmethod
    def find_line(component: Component, prefix: str) -> dict[str, str] | None:
        """The KEY=VALUE fields of the first line of this run's log that starts with `prefix` (None: not yet)."""
        with open(component.log_path, errors="replace") as log_file:
            log_file.seek(component.log_offset)
            lines = log_file.read().splitlines()
        for line in lines:
            if line.startswith(prefix):
                return dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
        return None

    def poll_ready(self, component: Component) -> bool:
        if component.ready is None:
            component.ready = self.find_line(component, "PDSERVE_READY ")
            if component.ready is not None:
                component.ready_wall = time.time()
                self._report_ready(component)
        return component.ready is not None

    def _report_ready(self, component: Component) -> None:
        took = time.monotonic() - component.started_at
        where = component.ready.get("url", component.where)
        restarted = f"; restart {len(component.restart_times)}" if component.restart_times else ""
        say(f"{component.name} ready ({where}, pid {component.process.pid}, {took:.1f}s{restarted})")

    def wait_ready(self, components: list[Component], deadline: float, first: Component | None = None) -> None:
        """Until each of `components` printed its ready line. While `first` is not ready, only its exit ends the
        wait: what the others' failures say is reported once it is ready, as if they had started after it."""
        waiting = list(components)
        while waiting:
            self.tick(deadline, "did not become ready", waiting[0], [first] if first in waiting else None)
            waiting = [component for component in waiting if not self.poll_ready(component)]

    def tick(self, deadline: float, why: str, component: Component, watched: list[Component] | None = None) -> None:
        """One poll interval; ComponentFailed when one of `watched` (default: every component) exited, or past
        the deadline."""
        if self.stopping:
            raise KeyboardInterrupt
        self.check_alive(watched)
        if time.monotonic() > deadline:
            raise ComponentFailed(component, f"{why} within --startup-timeout")
        time.sleep(POLL_S)

    # ---- serving: restarts ----

    def watch(self) -> None:
        """Serve until a signal, restarting what fails; ComponentFailed when nothing can serve."""
        while not self.stopping:
            now = time.monotonic()
            for component in self.components:
                self._supervise(component, now)
            self._check_serving()
            time.sleep(POLL_S)

    def _supervise(self, component: Component, now: float) -> None:
        if component.given_up:
            return
        if component.restart_at is not None:
            if now >= component.restart_at:
                component.restart_at = None
                component.restart_times.append(now)
                try:
                    self._spawn(component, "a")
                except OSError as exc:  # its log cannot be opened, or no process can start: a failed restart
                    self._on_failure(component, f"could not be restarted ({exc})", now)
            return
        why = self._failure(component, now)
        if why is not None:
            self._on_failure(component, why, now)

    def _failure(self, component: Component, now: float) -> str | None:
        """Why the component must be restarted now, or None while it is fine."""
        code = component.process.poll()
        if code is not None:
            return exit_reason(code)
        if not self.poll_ready(component):
            if now - component.started_at > self.policy.startup_s:
                self._kill(component)
                return f"did not become ready within {self.policy.startup_s:g}s; killed"
            return None
        idle = self._seconds_without_progress(component)
        if idle is not None and idle > self.policy.stall_s:
            self._kill(component)
            return f"made no progress for {idle:.1f}s (--stall-timeout {self.policy.stall_s:g}); killed"
        return None

    def _seconds_without_progress(self, component: Component) -> float | None:
        if component.progress_path is None or self.policy.stall_s <= 0:
            return None
        try:
            last = max(component.progress_path.stat().st_mtime, component.ready_wall)
        except OSError:
            last = component.ready_wall
        return time.time() - last

    @staticmethod
    def _kill(component: Component) -> None:
        component.process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        component.process.wait()

    def _on_failure(self, component: Component, why: str, now: float) -> None:
        why += full_disk_note(self.log_dir)
        say(f"warning: {component.name} (pid {component.process.pid}) {why}. Its last log lines "
            f"({component.log_path}):\n{log_tail(component.log_path, 10)}", error=True)
        policy = self.policy
        if policy.can_restart(component.restart_times, now):
            delay = policy.delay(component.restart_times, now)
            component.restart_at = now + delay
            say(f"restarting {component.name} in {delay:.1f}s (restart {policy.recent(component.restart_times, now) + 1}"
                f" of at most {policy.max_restarts} within {policy.window_s:g}s)", error=True)
            return
        if policy.keeps_restarting(component.name):
            delay = policy.delay(component.restart_times, now)
            component.restart_at = now + delay
            say(f"restarting {component.name} in {delay:.1f}s: its {policy.max_restarts} restarts within "
                f"{policy.window_s:g}s are used up (--max-restarts, --restart-window), so it is restarted on with a "
                f"backoff that doubles up to {policy.max_backoff_s:g}s; its log says why it keeps failing",
                error=True)
            return
        component.given_up = True
        say(f"error: {component.name} is not restarted: {policy.max_restarts} restarts within {policy.window_s:g}s "
            f"are used up (--max-restarts, --restart-window); serving with what is left", error=True)

    def _check_serving(self) -> None:
        """Nothing can serve without the router or without every decode engine: end `up` then."""
        for component in self.components:
            if component.name == "router" and component.given_up:
                raise ComponentFailed(component, "failed and its restarts are used up")
        decode = [c for c in self.components if c.name.startswith("decode-")]
        if decode and all(c.given_up for c in decode):
            raise ComponentFailed(decode[-1], "failed, and so did every decode engine, restarts used up")

    # ---- stopping ----

    def stop_all(self) -> None:
        """Engines first (they deregister), then the router; SIGKILL what outlives the bound."""
        engines = [c for c in self.components if c.name != "router"]
        routers = [c for c in self.components if c.name == "router"]
        for group in (engines, routers):
            for component in group:
                if component.process.poll() is None:
                    component.process.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                    component.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for component in group:
                try:
                    component.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    say(f"{component.name} did not stop within {STOP_TIMEOUT_S:.0f}s: killing it")
                    component.process.kill()
                    component.process.wait()
