"""A sweep's PNGs from its summary rows (matplotlib, Agg backend, imported only here and only when called):
TTFT p90, TPOT p90 and ITL p99 against load with one line per config, SLO attainment against load, and
goodput per engine per config as bars."""

from __future__ import annotations

import math
from pathlib import Path

from pdserve.bench.sweep_results import ATTAINMENT_TARGET

LATENCY_PLOTS = (("p90_ttft_ms", "TTFT p90 (ms)", "ttft_p90.png"),
                 ("p90_tpot_ms", "TPOT p90 (ms)", "tpot_p90.png"),
                 ("p99_itl_ms", "ITL p99 (ms)", "itl_p99.png"))
INSTALL_HINT = 'plots need matplotlib: pip install "pdserve[bench]" (or pass --no-plots)'


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display); a clear error when it is missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_axis(rows: list[dict]) -> tuple[str, str]:
    """(row field, axis label): the request rate when the runs vary it, else the concurrency."""
    rates = {row["request_rate"] for row in rows if _finite(row.get("request_rate"))}
    concurrencies = {row["max_concurrency"] for row in rows if row.get("max_concurrency") is not None}
    if len(rates) > 1 or not concurrencies:
        return "request_rate", "request rate (req/s)"
    return "max_concurrency", "max concurrency"


def series(rows: list[dict], x_field: str, y_field: str) -> dict[str, tuple[list[float], list[float]]]:
    """{line label: (xs, ys)} sorted by x; a line per config (and per concurrency when the x is the rate)."""
    other = "max_concurrency" if x_field == "request_rate" else "request_rate"
    others = {row.get(other) for row in rows if row.get(x_field) is not None}
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        x, y = row.get(x_field), row.get(y_field)
        if not _finite(x) or not _finite(y):
            continue
        label = row["config"]
        if len(others) > 1:
            label += f" ({'conc' if other == 'max_concurrency' else 'rate'} {_short(row.get(other))})"
        lines.setdefault(label, []).append((x, y))
    return {label: tuple(map(list, zip(*sorted(points)))) for label, points in lines.items()}  # in the sweep's order


def write_plots(rows: list[dict], goodputs: list[dict], out_dir: Path) -> list[Path]:
    """Every plot the rows allow; returns the PNGs written."""
    plt = pyplot()
    done = [row for row in rows if not row.get("error") and row.get("completed")]
    x_field, x_label = load_axis(done)
    written = []
    for y_field, y_label, filename in LATENCY_PLOTS:
        path = _line_plot(plt, series(done, x_field, y_field), x_label, y_label, out_dir / filename)
        written += [path] if path else []
    attainment = series(rows, x_field, "slo_attainment")
    path = _line_plot(plt, attainment, x_label, "SLO attainment", out_dir / "slo_attainment.png",
                      target=ATTAINMENT_TARGET)
    written += [path] if path else []
    bars = [g for g in goodputs if g.get("goodput_per_engine") is not None]
    if bars:
        written.append(_goodput_bars(plt, bars, out_dir / "goodput_per_engine.png"))
    return written


def _line_plot(plt, lines: dict, x_label: str, y_label: str, path: Path, target: float | None = None) -> Path | None:
    if not lines:
        return None
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in lines.items():
        axes.plot(xs, ys, marker="o", label=label)
    if target is not None:
        axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"{target:.0%} target")
        axes.set_ylim(-0.02, 1.02)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.set_title(f"{y_label} against load")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _goodput_bars(plt, goodputs: list[dict], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    labels = [g["config"] for g in goodputs]
    values = [g["goodput_per_engine"] for g in goodputs]
    bars = axes.bar(range(len(labels)), values, color="tab:blue")  # positions, so labels are never parsed as dates
    axes.set_xticks(range(len(labels)), labels)
    for bar, goodput in zip(bars, goodputs):
        note = "" if goodput.get("upper_bound") is not None else " (at least)"
        axes.annotate(f"{bar.get_height():.3g}{note}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    axes.set_ylabel("goodput per engine (req/s)")
    axes.set_title(f"Goodput per engine (>= {ATTAINMENT_TARGET:.0%} of requests within the SLOs)")
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _short(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
