"""A sweep of a shifting load (`--dataset phased`, or a trace with phase labels), phase by phase: for each phase
(its cycles together) and each layout, the requests that arrived in it, their SLO attainment and p90 TTFT and
TPOT, and which layout kept the most of them within the SLOs."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.sweep_report import load_label, loaded_rows

HEADERS = ("phase", "layout", "requests", "SLO attainment", "TTFT p90 (worst cycle)", "TPOT p90 (worst cycle)")


def phase_entries(rows: list[dict]) -> dict[tuple, dict[str, list[dict]]]:
    """{(phase, spec): {layout: [one entry per cycle]}} from each measured run's JSON, in the order met."""
    measured = loaded_rows(rows)
    many_loads = len({load_label(row) for row in measured}) > 1
    table: dict[tuple, dict[str, list[dict]]] = {}
    for row in measured:
        if not row.get("result_file"):
            continue
        phases = json.loads(Path(row["result_file"]).read_text()).get("phases") or []
        layout = f"{row['config']} at {load_label(row)}" if many_loads else row["config"]
        for entry in phases:
            table.setdefault((entry["phase"], entry.get("spec")), {}).setdefault(layout, []).append(entry)
    return table


def combined(entries: list[dict]) -> tuple[int, float | None, float | None, float | None]:
    """(requests, attainment over all of them, worst p90 TTFT, worst p90 TPOT) of one phase's cycles."""
    num = sum(entry["num_requests"] for entry in entries)
    scored = [(entry["slo_attainment"], entry["num_requests"]) for entry in entries
              if entry.get("slo_attainment") is not None]
    attainment = sum(a * n for a, n in scored) / sum(n for _, n in scored) if scored and num else None
    return num, attainment, _worst(entries, "p90_ttft_ms"), _worst(entries, "p90_tpot_ms")


def _worst(entries: list[dict], key: str) -> float | None:
    values = [entry[key] for entry in entries if entry.get(key) is not None]
    return max(values) if values else None


def phase_table(rows: list[dict]) -> str:
    """The markdown table and one sentence per phase naming its best layout; '' for a load without phases."""
    table = phase_entries(rows)
    if not table:
        return ""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    verdicts = []
    for (phase, spec), layouts in table.items():
        name = f"{phase} ({spec})" if spec else str(phase)
        scores = {}
        for layout, entries in layouts.items():
            num, attainment, ttft, tpot = combined(entries)
            scores[layout] = attainment
            lines.append(f"| {name} | {layout} | {num} | {_percent(attainment)} | {_ms(ttft)} | {_ms(tpot)} |")
        verdicts.append(_verdict(name, scores))
    return "\n".join(lines) + "\n\n" + "\n".join(verdicts)


def _verdict(name: str, scores: dict[str, float | None]) -> str:
    known = sorted(((a, layout) for layout, a in scores.items() if a is not None), reverse=True)
    if not known:
        return f"- Phase {name}: no SLOs, no attainment to compare."
    best, layout = known[0]
    rest = ", ".join(f"{other} {a:.0%}" for a, other in known[1:])
    return f"- Phase {name}: {layout} kept the most requests within the SLOs, {best:.0%}" + (
        f" ({rest})." if rest else ".")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"
