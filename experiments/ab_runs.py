"""A/B benchmarks whose two modes take turns (A B B A ...), so a machine that drifts weighs on both alike;
and their report: each figure's median per mode, and the ratio A / B."""

from __future__ import annotations

import statistics


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
