"""A sweep's PNGs from its summary rows (matplotlib, Agg backend, imported only here and only when called):
TTFT p90, TPOT p90 and ITL p99 against load (a line per config, or bars at a single load) with the SLO drawn,
SLO attainment against load, and goodput per engine as bars; the workload and SLOs in each title, the winner
marked."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.sweep_results import ATTAINMENT_TARGET

LATENCY_PLOTS = (("p90_ttft_ms", "TTFT p90 (ms)", "ttft_p90.png"),
                 ("p90_tpot_ms", "TPOT p90 (ms)", "tpot_p90.png"),
                 ("p99_itl_ms", "ITL p99 (ms)", "itl_p99.png"))
SLO_OF = {"p90_ttft_ms": "ttft", "p90_tpot_ms": "tpot"}  # the SLO line each latency plot draws
MARKERS = ("o", "s", "^", "D", "v", "P")
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


@dataclass(frozen=True)
class PlotContext:
    """What every plot's title and marks say: the workload and SLOs (a line of text), the SLOs, the winner."""
    subtitle: str = ""
    slos: dict[str, float] = field(default_factory=dict)
    winner: str | None = None


def write_plots(rows: list[dict], goodputs: list[dict], out_dir: Path, context: PlotContext | None = None) -> list[Path]:
    """Every plot the rows allow; returns the PNGs written."""
    plt = pyplot()
    context = context or PlotContext()
    done = [row for row in rows if not row.get("error") and row.get("completed")]
    x_field, x_label = load_axis(done)
    written = []
    for y_field, y_label, filename in LATENCY_PLOTS:
        slo = context.slos.get(SLO_OF.get(y_field, ""))
        limit = (slo, f"SLO {slo:g} ms") if slo else None
        written += _save(plt, load_figure(plt, series(done, x_field, y_field), x_label, y_label, context, limit),
                         out_dir / filename)
    target = (ATTAINMENT_TARGET, f"{ATTAINMENT_TARGET:.0%} target")
    figure = load_figure(plt, series(rows, x_field, "slo_attainment"), x_label, "SLO attainment", context, target)
    written += _save(plt, figure, out_dir / "slo_attainment.png")
    bars = [g for g in goodputs if g.get("goodput_per_engine") is not None]
    if bars:
        written += _save(plt, _goodput_bars(plt, bars, context), out_dir / "goodput_per_engine.png")
    return written


def load_figure(plt, lines: dict, x_label: str, y_label: str, context: PlotContext,
                limit: tuple[float, str] | None = None):
    """One metric against load: bars when every line is one point at the same load, lines otherwise (distinct
    marker shapes, each smaller than the one before and drawn on top, so none hides another). `limit`: a
    horizontal (value, label) line, an SLO or the attainment target. None without lines."""
    if not lines:
        return None
    figure, axes = plt.subplots(figsize=(7.2, 4.6))
    loads = {x for xs, _ in lines.values() for x in xs}
    labels = {label: f"{label} (winner)" if _config_of(label) == context.winner else label for label in lines}
    if len(loads) == 1 and all(len(xs) == 1 for xs, _ in lines.values()):
        _bars(axes, lines, labels, context.winner)
        axes.set_xlabel(f"at {x_label.split(' (')[0]} {_short(loads.pop())}")
    else:
        for index, (label, (xs, ys)) in enumerate(lines.items()):
            winner = _config_of(label) == context.winner
            axes.plot(xs, ys, marker=MARKERS[index % len(MARKERS)], markersize=max(4, 12 - 4 * index),
                      linewidth=2.6 if winner else 1.4, label=labels[label], zorder=3 + index)
        axes.set_xlabel(x_label)
    if limit is not None:
        axes.axhline(limit[0], color="tab:red", linestyle="--", linewidth=1, label=limit[1], zorder=2)
    if y_label == "SLO attainment":
        axes.set_ylim(-0.06, 1.08)  # a point at 0 drawn whole
    axes.set_ylabel(y_label)
    axes.set_title(_title(f"{y_label} against load", context), fontsize=10)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:  # bars name their servers on the axis: no legend, and no warning
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the plot, over no point
    figure.tight_layout()
    return figure


def _bars(axes, lines: dict, labels: dict, winner: str | None) -> None:
    names = list(lines)
    values = [lines[name][1][0] for name in names]
    colors = [f"C{index}" for index in range(len(names))]
    bars = axes.bar(range(len(names)), values, color=colors, zorder=3,
                    edgecolor=["black" if _config_of(name) == winner else "none" for name in names], linewidth=2)
    axes.set_xticks(range(len(names)), [labels[name] for name in names])
    for bar, value in zip(bars, values):
        axes.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                      va="bottom", fontsize=8)


def _goodput_bars(plt, goodputs: list[dict], context: PlotContext):
    figure, axes = plt.subplots(figsize=(7.2, 4.6))
    labels = [g["config"] + (" (winner)" if g["config"] == context.winner else "") for g in goodputs]
    values = [g["goodput_per_engine"] for g in goodputs]
    edges = ["black" if g["config"] == context.winner else "none" for g in goodputs]
    bars = axes.bar(range(len(labels)), values, color="tab:blue", edgecolor=edges, linewidth=2, zorder=3)
    axes.set_xticks(range(len(labels)), labels)  # positions, so labels are never parsed as dates
    for bar, goodput in zip(bars, goodputs):
        note = "" if goodput.get("upper_bound") is not None else " (at least)"
        axes.annotate(f"{bar.get_height():.3g}{note}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    axes.set_ylabel("goodput per engine (req/s)")
    axes.set_title(_title(f"Goodput per engine (>= {ATTAINMENT_TARGET:.0%} of requests within the SLOs)", context),
                   fontsize=10)
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def _save(plt, figure, path: Path) -> list[Path]:
    if figure is None:
        return []
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return [path]


def _title(text: str, context: PlotContext) -> str:
    subtitle = context.subtitle.replace("<=", "≤")
    return text + ("\n" + "\n".join(textwrap.wrap(subtitle, 80)) if subtitle else "")


def _config_of(label: str) -> str:
    return label.split(" (")[0]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _short(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
