"""A sweep's report.html: the comparison table, the plots (PNGs inlined as base64), the workload, the SLOs, the
machine and the commands, in one file that opens offline (no script, no stylesheet or image fetched)."""

from __future__ import annotations

import base64
import html
import importlib.metadata
import os
import platform
from pathlib import Path

from pdserve.bench.sweep_report import Comparison

STYLE = """body { font-family: sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.6rem; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
tr.winner td { font-weight: bold; background: #eef7ee; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5rem 0; }
pre { background: #f6f6f6; padding: 0.6rem; overflow-x: auto; white-space: pre-wrap; }
.answer { font-size: 1.15rem; }"""


def machine_facts(device: str, dtype: str | None = None) -> dict[str, str]:
    """What ran the sweep: CPU model and cores, native bf16 and AMX (or the GPU), the engines' dtype, OS, Python,
    pdserve and torch versions, the device."""
    from pdserve.engine.config import device_capability

    capability = device_capability("cpu")
    facts = {"device": device, "CPU": capability["name"], "cores": str(os.cpu_count()),
             "native bf16 / AMX": f"{_yes_no(capability['native_bf16'])} / {_yes_no(capability['amx'])}",
             **({"engines' dtype": dtype} if dtype else {}), "OS": platform.platform(),
             "Python": platform.python_version()}
    for package in ("pdserve", "torch"):
        try:
            facts[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return facts


def _yes_no(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def write_report(path: Path, comparison: Comparison, workload: str, slos_text: str, machine: dict[str, str],
                 commands: list[str], plots: list[Path]) -> Path:
    """report.html next to the plots it inlines; returns its path."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"><title>pdserve sweep</title>',
             f"<style>{STYLE}</style></head><body>", "<h1>pdserve sweep</h1>",
             f'<p class="answer">{html.escape(comparison.sentence)}</p>', _table(comparison),
             "<h2>Workload and SLOs</h2>",
             f"<ul><li>Workload: {html.escape(workload)}</li><li>SLOs: {html.escape(slos_text)}</li></ul>",
             "<h2>Plots</h2>", *(_image(plot) for plot in plots if plot.exists()),
             "<h2>Machine</h2>", "<table>",
             *(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in machine.items()),
             "</table>", "<h2>Commands</h2>", *(f"<pre>{html.escape(command)}</pre>" for command in commands),
             "<p>Every run's figures: summary.csv and runs/*.json in this folder.</p>", "</body></html>"]
    path.write_text("\n".join(parts) + "\n")
    return path


def _table(comparison: Comparison) -> str:
    head = "".join(f"<th>{html.escape(name)}</th>" for name in comparison.headers)
    body = []
    for cells in comparison.cells:
        winner = ' class="winner"' if comparison.winner and cells[0].startswith(f"{comparison.winner} ") else ""
        body.append(f"<tr{winner}>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<div><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}"></div>'
