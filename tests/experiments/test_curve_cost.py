"""The CURVE-cost benchmark's plan and arithmetic (the runs themselves are `pdserve up` + `pdserve bench`,
tested in test_sweep_e2e.py)."""

from __future__ import annotations

from tests.experiments import load_experiment

curve_cost = load_experiment("curve_cost")
FIGURES, mode_order, report = curve_cost.FIGURES, curve_cost.mode_order, curve_cost.report


def test_modes_alternate_so_each_runs_first_equally_often():
    assert mode_order(2) == ["curve", "insecure", "insecure", "curve"]
    order = mode_order(4)
    assert order.count("curve") == order.count("insecure") == 4
    assert [order[i] for i in range(0, 8, 2)].count("curve") == 2


def test_report_gives_medians_and_ratios():
    runs = {"curve": [dict.fromkeys(FIGURES, 110.0), dict.fromkeys(FIGURES, 130.0), dict.fromkeys(FIGURES, 900.0)],
            "insecure": [dict.fromkeys(FIGURES, 100.0)] * 3}
    table = report(runs)
    assert "| median_ttft_ms | 130.0 | 100.0 | 1.300 |" in table
    assert len(table.splitlines()) == 2 + len(FIGURES)
