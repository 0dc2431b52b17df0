"""The host's CPU in a CPU sweep: what the router (the sweep's `server_cpu_s`, from its process_cpu_seconds_total)
and the benchmark client (`client_cpu_s`) spent around each run, fitted over the runs of each layout of the sweep
(the router's work differs between layouts) as a background load (CPU seconds per second: heartbeats, /metrics
scrapes, the engines' per-step messages) plus a cost per streamed token. On a CPU host whose cores are
all the engines' (`pdserve sweep` pins one engine per core, and the client has no core left), that work runs on an
engine's core whenever none is idle; the simulator charges it there (HostEffects.cpu_per_token and
background_cores, host_effects.py; docs/benchmarking/plan.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from pdserve.planner.profile.fit import Profile

MICROSECONDS = 1e-6
MIN_RUNS = 3  # runs with both figures a fit needs (two unknowns, and one run to spare)


@dataclass(frozen=True)
class HostCpu:
    seconds_per_token: float
    background_cores: float  # CPU seconds per second, whatever the load
    source: str  # where the figures came from, for the report
    num_runs: int = 0  # the runs fitted (0: given, not measured)
    rms_error_s: float | None = None  # the fit's root-mean-square error over them, CPU seconds per run

    def describe(self) -> str:
        text = (f"host CPU {self.seconds_per_token / MICROSECONDS:.0f} us per streamed token + "
                f"{100 * self.background_cores:.2f}% of a core ({self.source}")
        if self.num_runs:
            text += f": router and client CPU of {self.num_runs} runs, fit error {self.rms_error_s:.2f} s per run"
        return text + ")"


NO_HOST_CPU = HostCpu(0.0, 0.0, "not charged")


def run_figures(run: dict) -> tuple[float, float, float] | None:
    """(duration s, output tokens, router + client CPU s) of one run; None without both CPU figures (a sweep from
    before `server_cpu_s`, or an external server)."""
    server_cpu = (run.get("server_metrics") or {}).get("server_cpu_s")
    client_cpu = run.get("client_cpu_s")
    if server_cpu is None or client_cpu is None or not run.get("duration"):
        return None
    return float(run["duration"]), float(run.get("total_output_tokens") or 0), float(server_cpu) + float(client_cpu)


def measured_host_cpu(runs: list[dict]) -> HostCpu | None:
    """Least squares over the runs with both figures: CPU = background x duration + per token x output tokens, both
    0 or more (a negative one is dropped and the other fitted alone); None with fewer than MIN_RUNS such runs."""
    figures = [f for f in map(run_figures, runs) if f is not None]
    if len(figures) < MIN_RUNS:
        return None
    table = np.array(figures)
    terms, cpu = table[:, :2], table[:, 2]
    coefficients = _nonnegative_fit(terms, cpu)
    rms = float(np.sqrt(np.mean((terms @ coefficients - cpu) ** 2)))
    return HostCpu(float(coefficients[1]), float(coefficients[0]), "measured", len(figures), rms)


def _nonnegative_fit(terms: np.ndarray, values: np.ndarray) -> np.ndarray:
    coefficients = np.linalg.lstsq(terms, values, rcond=None)[0]
    if (coefficients >= 0).all():
        return coefficients
    best = np.zeros(2)
    for keep in (0, 1):  # one term alone, the better of the two
        column = terms[:, keep]
        alone = np.zeros(2)
        alone[keep] = max(float(column @ values / (column @ column)), 0.0) if column.any() else 0.0
        if not best.any() or np.sum((terms @ alone - values) ** 2) < np.sum((terms @ best - values) ** 2):
            best = alone
    return best


def given_host_cpu(args: argparse.Namespace) -> HostCpu | None:
    """The flags' figures (a missing one reads as 0), or None when neither is given."""
    per_token, background = args.host_cpu_per_token, args.host_background_cpu
    if per_token is None and background is None:
        return None
    per_token, background = per_token or 0.0, background or 0.0
    if not (0 <= per_token < 1e6):
        raise ValueError(f"--host-cpu-per-token {per_token:g}: give the microseconds of host CPU (router and clients) "
                         "per streamed token, 0 or more (0: the host has cores of its own)")
    if not (0 <= background < 1):
        raise ValueError(f"--host-background-cpu {background:g}: give the share of one core the host's processes take "
                         "whatever the load, from 0 up to below 1 (0.01 = 1%)")
    if not per_token and not background:
        return NO_HOST_CPU
    return HostCpu(per_token * MICROSECONDS, background, "given")


def plan_host_cpu(args: argparse.Namespace) -> HostCpu:
    """`pdserve plan`: the flags' figures, or none."""
    return given_host_cpu(args) or NO_HOST_CPU


def validate_host_cpu(args: argparse.Namespace, profile: Profile, configs: list[str], source_runs: list[dict],
                      source: str) -> dict[str, HostCpu]:
    """`pdserve plan --validate`, per config of the sweep: the flags' figures; else, for a CPU profile, those fitted
    to that layout's runs in `source_runs` (the sweep's own, or --host-cpu-from's; none where they did not record
    them); none for a GPU profile (the host's cores are not the engines')."""
    given = given_host_cpu(args)
    if given is not None or not profile.on_cpu:
        return dict.fromkeys(configs, given or NO_HOST_CPU)
    unmeasured = HostCpu(0.0, 0.0, f"not charged: {source} has no server_cpu_s for the layout")
    return {config: measured_host_cpu([run for run in source_runs if run.get("config") == config]) or unmeasured
            for config in configs}
