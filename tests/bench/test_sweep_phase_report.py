"""The per-phase comparison of a sweep of a shifting load: cycles of one phase pooled by request count, the
worst cycle's p90s, and each phase's best layout named."""

from __future__ import annotations

import json

from pdserve.bench.sweep_phase_report import phase_table


def run_row(tmp_path, config: str, phases: list[dict], rate: float = float("inf")) -> dict:
    path = tmp_path / f"{config}.json"
    path.write_text(json.dumps({"phases": phases}))
    return {"config": config, "phase": "sweep", "request_rate": rate, "completed": 10, "result_file": str(path)}


def entry(phase: int, cycle: int, num: int, attainment: float | None, ttft: float, tpot: float) -> dict:
    return {"phase": phase, "cycle": cycle, "spec": f"{1000 if phase == 1 else 128}:48:0.2:60",
            "num_requests": num, "slo_attainment": attainment, "p90_ttft_ms": ttft, "p90_tpot_ms": tpot}


def test_cycles_are_pooled_and_each_phase_names_its_best_layout(tmp_path):
    rows = [
        run_row(tmp_path, "1P1D", [entry(1, 1, 10, 0.9, 4000, 80), entry(2, 1, 30, 0.2, 500, 190),
                                   entry(1, 2, 30, 0.5, 9000, 85), entry(2, 2, 10, 0.4, 450, 170)]),
        run_row(tmp_path, "adaptive", [entry(1, 1, 10, 1.0, 3000, 70), entry(2, 1, 30, 1.0, 400, 100),
                                       entry(1, 2, 30, 0.8, 5000, 90), entry(2, 2, 10, 0.9, 420, 110)]),
    ]
    text = phase_table(rows)
    # 1P1D phase 1: (0.9 * 10 + 0.5 * 30) / 40 = 60%; its worst p90s over the two cycles
    assert "| 1 (1000:48:0.2:60) | 1P1D | 40 | 60% | 9,000 ms | 85 ms |" in text
    assert "| 2 (128:48:0.2:60) | 1P1D | 40 | 25% | 500 ms | 190 ms |" in text
    assert "| 1 (1000:48:0.2:60) | adaptive | 40 | 85% | 5,000 ms | 90 ms |" in text
    assert "- Phase 1 (1000:48:0.2:60): adaptive kept the most requests within the SLOs, 85% (1P1D 60%)." in text
    assert "- Phase 2 (128:48:0.2:60): adaptive kept the most requests within the SLOs, 98% (1P1D 25%)." in text


def test_a_load_without_phases_has_no_table_and_no_slos_no_verdict(tmp_path):
    assert phase_table([run_row(tmp_path, "0P2D", [])]) == ""
    text = phase_table([run_row(tmp_path, "0P2D", [entry(1, 0, 5, None, 100, 10)])])
    assert "| 0P2D | 5 | - |" in text and "no SLOs" in text


def test_layouts_at_several_loads_are_told_apart(tmp_path):
    rows = [run_row(tmp_path, "0P2D", [entry(1, 0, 5, 1.0, 100, 10)]), {
        **run_row(tmp_path, "0P2D-c", [entry(1, 0, 5, 0.6, 100, 10)]), "config": "0P2D", "max_concurrency": 4}]
    text = phase_table(rows)
    assert "| 0P2D at inf req/s | 5 | 100% |" in text and "| 0P2D at inf req/s, conc 4 | 5 | 60% |" in text
