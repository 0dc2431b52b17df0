"""`pdserve plan`'s PNGs (matplotlib through bench/sweep_plots.py's Agg loader): predicted goodput per
engine per split, and predicted against measured figures of a validated sweep."""

from __future__ import annotations

import math
from pathlib import Path

from pdserve.bench.sweep_plots import pyplot


def can_plot(png: str) -> bool:
    """Whether matplotlib is installed (the `[bench]` extra); if not, a sentence that the PNG is left out and why."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{png} left out: the plots need matplotlib, pip install \"pdserve[bench]\" (the table and the JSON "
              "do not)")
        return False
    return True


def plot_goodput(rows: list[dict], path: Path, best: dict | None = None, title: str = "") -> None:
    """One bar per split; the recommended one drawn in another colour and labelled; the SLOs and workload on top."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 0.22 * len(rows)), 4.4))
    positions = range(len(rows))  # numbers, not the names: matplotlib would try "0P3D" as a date
    picked = best["config"] if best else None
    colors = ["tab:orange" if row["config"] == picked else "tab:blue" for row in rows]
    values = bar_heights([row["goodput_per_engine"] for row in rows])
    bars = ax.bar(positions, values, color=colors)
    for bar, row in zip(bars, rows):
        if not math.isfinite(row["goodput_per_engine"]):  # the search found no rate it fails at
            bar.set_hatch("//")
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() / 2, "no limit\nfound", ha="center",
                    va="center", fontsize=7, rotation=90)
    ax.set_xticks(list(positions), [row["config"] for row in rows])
    if picked is not None:
        where = next(i for i, row in enumerate(rows) if row["config"] == picked)
        ax.annotate(f"recommended: {picked}\n{rows[where]['goodput_per_engine']:.3g} req/s per engine",
                    (where, values[where]),
                    xytext=(0, 6), textcoords="offset points", ha="center", va="bottom", fontsize=8,
                    color="tab:orange", fontweight="bold")
        ax.set_ylim(0, max(values) * 1.3 or 1.0)  # room for the label above the tallest bar
    else:
        ax.text(0.5, 0.5, "no split meets the SLOs", transform=ax.transAxes, ha="center", color="tab:red")
    ax.set_ylabel("predicted goodput per engine (req/s)")
    ax.set_xlabel("split: x prefill (P) and y decode (D) engines; 0PyD colocated")
    ax.set_title(title or f"pdserve plan: {rows[0]['num_engines']} engines", fontsize=9)
    ax.tick_params(axis="x", rotation=90 if len(rows) > 12 else 0, labelsize=7 if len(rows) > 24 else 9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bar_heights(values: list[float]) -> list[float]:
    """Goodputs as bar heights: an unbounded (infinite) one drawn a little above the highest finite one."""
    finite = [v for v in values if math.isfinite(v)]
    top = max(finite, default=0.0) * 1.1 or 1.0
    return [v if math.isfinite(v) else top for v in values]


MARKERS = "osD^v<>"
VALIDATION_PANELS = (("slo_attainment", "share of requests within the SLOs"), ("median_ttft_ms", "TTFT p50 (ms)"),
                     ("median_tpot_ms", "TPOT p50 (ms)"), ("p90_ttft_ms", "TTFT p90 (ms)"),
                     ("p90_tpot_ms", "TPOT p90 (ms)"))


def plot_validation(rows: list[dict], path: Path) -> None:
    """Predicted against measured, one panel per figure on a 2-column grid (attainment first, across the top);
    on the dashed diagonal a prediction is exact."""
    plt = pyplot()
    fig = plt.figure(figsize=(9.0, 11.0))
    grid = fig.add_gridspec(3, 2)
    axes = [fig.add_subplot(grid[0, :])] + [fig.add_subplot(grid[1 + i // 2, i % 2]) for i in range(4)]
    for ax, (key, title) in zip(axes, VALIDATION_PANELS):
        draw_validation_panel(ax, rows, key, title)
    fig.suptitle("pdserve plan --validate: predicted against measured (on the dashed line: exact)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_validation_panel(ax, rows: list[dict], key: str, title: str) -> None:
    points = [(r[f"measured_{key}"], r[f"predicted_{key}"], r["config"]) for r in rows
              if r[f"measured_{key}"] is not None and r[f"predicted_{key}"] is not None]
    for n, config in enumerate(sorted({c for _, _, c in points})):  # shapes and sizes apart: none hides another
        xs = [m for m, _, c in points if c == config]
        ys = [p for _, p, c in points if c == config]
        ax.scatter(xs, ys, label=config, marker=MARKERS[n % len(MARKERS)], s=max(20, 70 - 15 * n), alpha=0.75,
                   edgecolors="black", linewidths=0.5)
    values = [v for m, p, _ in points for v in (m, p)] or [0.0, 1.0]
    low, high = min(values), max(values)
    ax.plot([low, high], [low, high], color="grey", linewidth=1, linestyle="--")
    ax.set_xlabel(f"measured {title}")
    ax.set_ylabel(f"predicted {title}")
    ax.set_title(title, fontsize=10)
    if points:
        ax.legend(fontsize=8)
