"""A sweep's answer: one row per layout (goodput in total and per engine, SLO attainment at each load, TTFT and
TPOT at the highest rate that met the SLOs), the winner in a sentence, and summary.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.sweep_results import ATTAINMENT_TARGET

LOAD_PHASES = ("sweep", "search")  # measured loads (not warm-up, unloaded or reference runs)
LATENCY_COLUMNS = (("TTFT p50", "median_ttft_ms"), ("TTFT p90", "p90_ttft_ms"),
                   ("TPOT p50", "median_tpot_ms"), ("TPOT p90", "p90_tpot_ms"))


@dataclass(frozen=True)
class Comparison:
    headers: list[str]
    cells: list[list[str]]  # one row of cells per layout, in the sweep's order
    winner: str | None  # the highest goodput per engine (tied: the higher attainment at the next load); None: no
    # SLOs, or no clear winner
    sentence: str


def load_label(row: dict) -> str:
    """'2 req/s', 'inf req/s, conc 8': a listed load, as the table's columns name it."""
    rate = row["request_rate"]
    label = f"{rate:g} req/s"
    if row.get("max_concurrency") is not None:
        label += f", conc {int(row['max_concurrency'])}"
    return label


def loaded_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row.get("phase") in LOAD_PHASES and not row.get("error") and row.get("completed")]


def compare(rows: list[dict], goodputs: list[dict], slos: dict[str, float]) -> Comparison:
    """The comparison table of a finished (or interrupted) sweep."""
    measured = loaded_rows(rows)
    configs = list(dict.fromkeys(row["config"] for row in rows if row.get("phase") in (*LOAD_PHASES, "start")))
    loads = list(dict.fromkeys(load_label(row) for row in measured if row["phase"] == "sweep"))
    by_config = {g["config"]: g for g in goodputs}
    winner, sentence = pick_winner(goodputs, slos)
    if slos and not any(_finite_rate(row) for row in measured if row["phase"] == "sweep"):
        winner, sentence = winner_by_attainment(measured)
    elif slos and winner is None and not any(g["goodput_per_engine"] > 0 for g in goodputs):
        sentence += closest(measured)
    elif slos and winner is None:
        winner, sentence = break_tie(goodputs, measured) or (winner, sentence)
    basis = "at the highest rate within the SLOs" if slos else "at the highest load"
    headers = ["layout", "engines", "goodput (req/s)", "per engine"]
    headers += [f"attainment @ {load}" for load in loads] if slos else []
    headers += [f"{name} (ms)" for name, _ in LATENCY_COLUMNS] + [basis]
    cells = []
    for config in configs:
        own = [row for row in measured if row["config"] == config]
        engines = next((row["num_engines"] for row in rows if row["config"] == config), None)
        row_cells = [f"{config} (winner)" if config == winner else config, _count(engines)]
        row_cells += _goodput_cells(by_config.get(config))
        if slos:
            attained = {load_label(row): row["slo_attainment"] for row in own if row["phase"] == "sweep"}
            row_cells += [_percent(attained.get(load)) for load in loads]
        at, met = _latency_row(own, bool(slos))
        row_cells += [_ms(at.get(field)) if at else "-" for _, field in LATENCY_COLUMNS]
        row_cells.append("-" if at is None else load_label(at) if met else f"none met; at {load_label(at)}")
        cells.append(row_cells)
    return Comparison(headers, cells, winner, sentence)


def pick_winner(goodputs: list[dict], slos: dict[str, float]) -> tuple[str | None, str]:
    """(the winner or None, the sentence that says who won and by how much)."""
    if not slos:
        return None, "No SLOs were given, so there is no goodput to compare: pass --goodput ttft:MS tpot:MS."
    ranked = sorted(goodputs, key=lambda g: g["goodput_per_engine"], reverse=True)
    if not ranked or ranked[0]["goodput_per_engine"] <= 0:
        return None, (f"No layout kept {ATTAINMENT_TARGET:.0%} of requests within the SLOs at any rate tried: "
                      "lower the rates or loosen the SLOs.")
    best = ranked[0]
    if len(ranked) == 1:
        return best["config"], f"{best['config']} is the only layout measured: {_per_engine(best)}."
    second = ranked[1]
    if math.isclose(best["goodput_per_engine"], second["goodput_per_engine"], rel_tol=1e-9):
        if best.get("upper_bound") is None and second.get("upper_bound") is None:
            why = "both met the SLOs at every rate tried: add higher rates (or --find-goodput) to separate them"
        else:
            why = "their goodputs are equal at the rates tried"
        return None, f"No winner: {best['config']} and {second['config']} tie at {_per_engine(best)}; {why}."
    if second["goodput_per_engine"] <= 0:
        return best["config"], (f"{best['config']} wins: {_per_engine(best)}, while {second['config']} met the "
                                "SLOs at no rate tried.")
    ratio = best["goodput_per_engine"] / second["goodput_per_engine"]
    return best["config"], (f"{best['config']} wins: {_per_engine(best)} against {second['config']}'s "
                            f"{_per_engine(second)}, {ratio:.2f}x ({ratio - 1:+.0%}).")


def break_tie(goodputs: list[dict], measured: list[dict]) -> tuple[str, str] | None:
    """Two layouts whose goodputs tie, both missing at some rate tried: the one that kept more requests within the
    SLOs at the lightest listed rate where they missed (the next step of the load), if one did. None: no such rate,
    or they tie there too."""
    best, second = sorted(goodputs, key=lambda g: g["goodput_per_engine"], reverse=True)[:2]
    tied = (best["config"], second["config"])
    above = [row for row in measured if row["phase"] == "sweep" and row["config"] in tied and _finite_rate(row)
             and row["request_rate"] > best["goodput"] and row.get("slo_attainment") is not None]
    for rate in sorted({row["request_rate"] for row in above}):
        at = {row["config"]: row["slo_attainment"] for row in above if row["request_rate"] == rate}
        if len(at) < 2:
            continue
        if math.isclose(at[tied[0]], at[tied[1]], abs_tol=1e-9):
            return None
        lead, other = sorted(tied, key=lambda config: at[config], reverse=True)
        return lead, (f"{lead} wins on the next load: both reach {_per_engine(best)}, and at {rate:g} req/s "
                      f"{lead} kept {at[lead]:.0%} of requests within the SLOs against {other}'s {at[other]:.0%} "
                      f"({100 * (at[lead] - at[other]):.0f} points).")
    return None


def winner_by_attainment(measured: list[dict]) -> tuple[str | None, str]:
    """For a sweep with no finite request rate (--max-concurrencies, or a phased or trace schedule), where goodput
    in req/s is not defined: the layout whose runs kept the most requests within the SLOs, on average."""
    by_config: dict[str, list[float]] = {}
    for row in measured:
        if row["phase"] == "sweep" and row.get("slo_attainment") is not None:
            by_config.setdefault(row["config"], []).append(row["slo_attainment"])
    if not by_config:
        return None, "No run measured SLO attainment."
    why = "these runs had no finite request rate, so layouts are compared by SLO attainment, not goodput"
    ranked = sorted(((sum(v) / len(v), config) for config, v in by_config.items()), reverse=True)
    (best, best_config), rest = ranked[0], ranked[1:]
    if not rest:
        return best_config, f"{best_config} kept {best:.0%} of requests within the SLOs ({why})."
    second, second_config = rest[0]
    if math.isclose(best, second, abs_tol=1e-9):
        return None, f"No winner: {best_config} and {second_config} both kept {best:.0%} within the SLOs ({why})."
    return best_config, (f"{best_config} wins: {best:.0%} of requests within the SLOs against {second_config}'s "
                         f"{second:.0%}, {100 * (best - second):.0f} points ({why}).")


def _finite_rate(row: dict) -> bool:
    return row.get("request_rate") is not None and math.isfinite(row["request_rate"])


def closest(measured: list[dict]) -> str:
    """' Closest: 0P2D, 67% within the SLOs at 0.15 req/s (1P1D: 33%).' at the lightest listed load; '' when
    fewer than two layouts ran it, or the closest two tie."""
    listed = [row for row in measured if row["phase"] == "sweep" and row.get("slo_attainment") is not None]
    if not listed:
        return ""
    lightest = min(listed, key=lambda row: (row["request_rate"], row.get("max_concurrency") or math.inf))
    at = [row for row in listed if load_label(row) == load_label(lightest)]
    if len(at) < 2:
        return ""
    at.sort(key=lambda row: row["slo_attainment"], reverse=True)
    if at[0]["slo_attainment"] == at[1]["slo_attainment"]:
        return ""  # no layout came closer than another
    others = ", ".join(f"{row['config']}: {row['slo_attainment']:.0%}" for row in at[1:])
    return (f" Closest: {at[0]['config']}, {at[0]['slo_attainment']:.0%} within the SLOs at {load_label(lightest)} "
            f"({others}).")


def _per_engine(goodput: dict) -> str:
    floor = "at least " if goodput.get("upper_bound") is None else ""
    return (f"{floor}{goodput['goodput_per_engine']:.3g} req/s per engine "
            f"({goodput['goodput']:.3g} in total on {goodput['num_engines']:g})")


def _latency_row(rows: list[dict], has_slos: bool) -> tuple[dict | None, bool]:
    """(the run at the highest rate whose attainment met the target, True); when none met it, (the lightest load,
    False). Without SLOs: (the heaviest load, True)."""
    def load(row: dict) -> tuple[float, float]:
        return row["request_rate"], row.get("max_concurrency") or math.inf

    met = [row for row in rows if not has_slos or (row.get("slo_attainment") or 0) >= ATTAINMENT_TARGET]
    if met or not rows:
        return max(met, key=load, default=None), True
    return min(rows, key=load), False


def _goodput_cells(goodput: dict | None) -> list[str]:
    if goodput is None:
        return ["-", "-"]
    floor = ">= " if goodput.get("upper_bound") is None else ""
    return [f"{floor}{goodput['goodput']:.3g}", f"{floor}{goodput['goodput_per_engine']:.3g}"]


def markdown_table(comparison: Comparison) -> str:
    lines = ["| " + " | ".join(comparison.headers) + " |",
             "|" + "|".join("---" for _ in comparison.headers) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in comparison.cells]
    return "\n".join(lines)


def describe_workload(rows: list[dict]) -> str:
    """'about 1000 tokens in / 48 out per request, 50 requests per run', from the first measured load."""
    measured = loaded_rows(rows)
    if not measured:
        return "no load was measured"
    row = measured[0]
    completed = row["completed"]
    requests = int(completed + (row.get("failed") or 0))
    return (f"about {row['total_input_tokens'] / completed:.0f} tokens in / {row['total_output_tokens'] / completed:.0f}"
            f" out per request, {requests} requests per run")


def describe_slos(slos: dict[str, float]) -> str:
    if not slos:
        return "no SLOs"
    limits = ", ".join(f"{metric.upper()} <= {limit:g} ms" for metric, limit in slos.items())
    return f"{limits} for {ATTAINMENT_TARGET:.0%} of requests"


def write_summary_md(path: Path, comparison: Comparison, workload: str, slos: dict[str, float],
                     phases: str = "") -> Path:
    """phases: the per-phase table of a shifting load (bench/sweep_phase_report.py), or ''."""
    text = (f"# pdserve sweep\n\n{comparison.sentence}\n\n- Workload: {workload}\n- SLOs: {describe_slos(slos)}\n\n"
            f"{markdown_table(comparison)}\n\nGoodput: the highest request rate at which at least "
            f"{ATTAINMENT_TARGET:.0%} of requests met every SLO (>= : met at every rate tried). Every run's figures "
            "are in summary.csv and runs/*.json.\n")
    if phases:
        text += f"\n## Per phase\n\nEach phase's requests (those that arrived in it), over all its cycles.\n\n{phases}\n"
    path.write_text(text)
    return path


def _count(value) -> str:
    return "-" if value is None else str(int(value))


def _percent(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.0f}" if value >= 10 else f"{value:.2g}"
