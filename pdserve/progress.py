"""Progress over a long job's steps: a tqdm bar on a terminal; in a log (output not a terminal), one line per
step with its number and an estimate of the time left. A step may have a floor, the seconds it is known to take
at least (a load run's arrivals span num_prompts / rate); each step is estimated as its floor plus the mean time
the finished steps took beyond theirs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_seconds(seconds: float) -> str:
    """75.2 -> '1m15s', 8.4 -> '8s'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """`start(label)` as each step begins, `finish()` when it ends, `note(line)` for a line of results.

    tty=None: a bar when `file` is a terminal. `first_estimate_s`: what a step takes beyond its floor before any
    step has finished, None to say the time left is not known yet. `floors`: each step's floor in seconds, in
    order (None: every floor 0)."""

    def __init__(self, total: int, desc: str, file: TextIO | None = None, unit: str = "step",
                 tty: bool | None = None, first_estimate_s: float | None = None,
                 floors: list[float] | None = None) -> None:
        self.file = file or sys.stderr
        self.total, self.desc, self.done = total, desc, 0
        self.tty = _is_terminal(self.file) if tty is None else tty
        self.first_estimate_s = first_estimate_s
        self.started = time.monotonic()
        self.floors = list(floors) if floors is not None else [0.0] * total  # of the steps not finished yet
        self.beyond_floor_s = 0.0  # the finished steps' time beyond their floors, summed
        self.last_finish = time.monotonic()  # a step's time runs from the last one's end (set-up between counts)
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, dynamic_ncols=True)

    def add(self, steps: int = 1) -> None:
        """More steps than first counted (e.g. a search's probes), next in order, floors unknown (0); negative:
        the next -steps steps will not run."""
        self.total += steps
        if steps >= 0:
            self.floors[:0] = [0.0] * steps
        else:
            del self.floors[:-steps]
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            return
        print(f"{self.desc} [{self.done + 1}/{self.total}] {label} ({self.time_left()})", file=self.file, flush=True)

    def finish(self) -> None:
        now, floor = time.monotonic(), self.floors.pop(0) if self.floors else 0.0
        self.beyond_floor_s += max(0.0, now - self.last_finish - floor)
        self.last_finish = now
        self.done += 1
        if self.bar is not None:
            self.bar.update()

    def note(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.file)
        else:
            print(line, file=self.file, flush=True)

    def time_left(self) -> str:
        """The estimate for the steps from the one starting now (before its start) to the last."""
        remaining = self.total - self.done
        if self.done:
            beyond = self.beyond_floor_s / self.done
        elif self.first_estimate_s is not None:
            beyond = self.first_estimate_s
        else:
            return "time left not known yet"
        return f"about {format_seconds(beyond * remaining + sum(self.floors[:remaining]))} left"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False
