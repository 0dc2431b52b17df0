"""A/B benchmarks whose two modes take turns (A B B A ...), so a machine that drifts weighs on both alike;
one bench load's figures against a server; and the report: each figure's median per mode, and the ratio A / B."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path


def add_load_args(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """The options every A/B script shares: repeats, the load's size, where its runs go."""
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (alternating: ABBA ...)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--output-dir", default=None, help="where runs and logs go (default: a new temp dir)")


def mode_order(modes: tuple[str, str], repeats: int) -> list[str]:
    """("a", "b"), 2 -> ["a", "b", "b", "a"]: each mode runs first as often as the other."""
    first, second = modes
    order: list[str] = []
    for repeat in range(repeats):
        order += [first, second] if repeat % 2 == 0 else [second, first]
    return order


def median_table(results: dict[str, list[dict]], modes: tuple[str, str], labels: tuple[str, str],
                 figures: tuple[str, ...]) -> str:
    """A markdown table: a row per figure, the median of each mode's runs and their ratio (A / B)."""
    medians = {mode: {f: statistics.median(run[f] for run in results[mode]) for f in figures} for mode in modes}
    a, b = modes
    lines = [f"| figure | {labels[0]} | {labels[1]} | {labels[0]} / {labels[1]} |", "| --- | ---: | ---: | ---: |"]
    for figure in figures:
        lines.append(f"| {figure} | {medians[a][figure]:.1f} | {medians[b][figure]:.1f} | "
                     f"{medians[a][figure] / medians[b][figure]:.3f} |")
    return "\n".join(lines)


def run_alternating(modes: tuple[str, str], repeats: int, run_one: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """run_one(mode, index) for each run in mode_order: every mode's results, in its order."""
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for index, mode in enumerate(mode_order(modes, repeats)):
        results[mode].append(run_one(mode, index))
    return results


def output_dir(given: str | None, prefix: str) -> Path:
    """--output-dir, or a new temporary folder named `prefix`..."""
    out = Path(given or tempfile.mkdtemp(prefix=prefix))
    out.mkdir(parents=True, exist_ok=True)
    return out


def save_and_print(results: dict[str, list[dict]], out: Path, name: str, table: str) -> int:
    """The runs' figures into out/<name>.json, the table and where the runs are on stdout; exit status 0."""
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(table)
    print(f"runs and logs: {out}")
    return 0


def bench_figures(options, url: str, info, out: Path, figures: tuple[str, ...],
                  client_cores: list[int] | None = None) -> dict:
    """One `pdserve bench` load against `url` after a warm-up of 4 requests: the run's `figures`; a RuntimeError
    naming `out` where a request did not complete."""
    from pdserve.bench.sweep_runs import run_bench, warm_up

    warm_up(options, url, count=4)
    _, result = run_bench(options, url, info, out, slos={}, client_cores=client_cores)
    if result is None or result["failed"]:
        raise RuntimeError(f"the run {info.config} did not complete every request: see {out}")
    return {figure: result[figure] for figure in figures}
