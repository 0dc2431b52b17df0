"""`pdserve plan`'s PNGs (matplotlib through bench/sweep_plots.py's Agg loader): predicted goodput per
engine per split, and predicted against measured figures of a validated sweep."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.sweep_plots import pyplot


def plot_goodput(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(rows)), 4.0))
    positions = range(len(rows))  # numbers, not the names: matplotlib would try "0P3D" as a date
    ax.bar(positions, [row["goodput_per_engine"] for row in rows], color="tab:blue")
    ax.set_xticks(list(positions), [row["config"] for row in rows])
    ax.set_ylabel("predicted goodput per engine (req/s)")
    ax.set_xlabel("split")
    ax.set_title(f"pdserve plan: {rows[0]['num_engines']} engines")
    ax.tick_params(axis="x", rotation=90 if len(rows) > 12 else 0, labelsize=7 if len(rows) > 24 else 9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_validation(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    panels = (("slo_attainment", "SLO attainment"), ("median_ttft_ms", "TTFT p50 (ms)"),
              ("p90_ttft_ms", "TTFT p90 (ms)"), ("median_tpot_ms", "TPOT p50 (ms)"), ("p90_tpot_ms", "TPOT p90 (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 4.0))
    for ax, (key, title) in zip(axes, panels):
        points = [(r[f"measured_{key}"], r[f"predicted_{key}"], r["config"]) for r in rows
                  if r[f"measured_{key}"] is not None and r[f"predicted_{key}"] is not None]
        for config in sorted({c for _, _, c in points}):
            xs = [m for m, _, c in points if c == config]
            ys = [p for _, p, c in points if c == config]
            ax.scatter(xs, ys, label=config)
        values = [v for m, p, _ in points for v in (m, p)] or [0.0, 1.0]
        low, high = min(values), max(values)
        ax.plot([low, high], [low, high], color="grey", linewidth=1, linestyle="--")
        ax.set_xlabel(f"measured {title}")
        ax.set_ylabel(f"predicted {title}")
        ax.legend(fontsize=8)
    fig.suptitle("pdserve plan --validate: predicted against measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
