"""Progress over a long job's steps: a tqdm bar on a terminal; in a log (output not a terminal), one line per
step with its number and an estimate of the time left, from the average step so far."""

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

    tty=None: a bar when `file` is a terminal. `first_estimate_s`: what the first step is expected to take
    (the estimate before any step has finished), None to say the time left is not known yet."""

    def __init__(self, total: int, desc: str, file: TextIO | None = None, unit: str = "step",
                 tty: bool | None = None, first_estimate_s: float | None = None) -> None:
        self.file = file or sys.stderr
        self.total, self.desc, self.done = total, desc, 0
        self.tty = _is_terminal(self.file) if tty is None else tty
        self.started = time.monotonic()
        self.first_estimate_s = first_estimate_s
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, dynamic_ncols=True)

    def add(self, steps: int = 1) -> None:
        """More steps than first counted (e.g. a search's probes)."""
        self.total += steps
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            return
        print(f"{self.desc} [{self.done + 1}/{self.total}] {label} ({self.time_left()})", file=self.file, flush=True)

    def finish(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()

    def note(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.file)
        else:
            print(line, file=self.file, flush=True)

    def time_left(self) -> str:
        remaining = self.total - self.done
        if self.done:
            per_step = (time.monotonic() - self.started) / self.done
        elif self.first_estimate_s is not None:
            per_step = self.first_estimate_s
        else:
            return "time left not known yet"
        return f"about {format_seconds(per_step * remaining)} left"

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
