"""The A/B helpers the up-against-up experiments share (experiments/ab_runs.py), and pin_cost's plan and report
(the runs themselves are `pdserve up` + `pdserve bench`, tested in test_sweep_e2e.py)."""

from __future__ import annotations

import json

from tests.experiments import load_experiment

ab_runs = load_experiment("ab_runs")
pin_cost = load_experiment("pin_cost")


def test_runs_alternate_and_each_mode_keeps_its_own_results_in_order():
    calls = []

    def one_run(mode: str, index: int) -> dict:
        calls.append((mode, index))
        return {"index": index}

    results = ab_runs.run_alternating(("a", "b"), 2, one_run)
    assert calls == [("a", 0), ("b", 1), ("b", 2), ("a", 3)]
    assert results == {"a": [{"index": 0}, {"index": 3}], "b": [{"index": 1}, {"index": 2}]}


def test_results_are_saved_and_the_table_printed(tmp_path, capsys):
    out = ab_runs.output_dir(str(tmp_path / "new"), "unused-")
    assert ab_runs.save_and_print({"a": [{"x": 1.0}]}, out, "name", "| table |") == 0
    assert json.loads((out / "name.json").read_text()) == {"a": [{"x": 1.0}]}
    assert capsys.readouterr().out == f"| table |\nruns and logs: {out}\n"


def test_pin_cost_alternates_pinned_and_unpinned_and_gives_the_ratio():
    assert pin_cost.mode_order(2) == ["pinned", "unpinned", "unpinned", "pinned"]
    runs = {"pinned": [dict.fromkeys(pin_cost.FIGURES, 100.0)] * 2,
            "unpinned": [dict.fromkeys(pin_cost.FIGURES, 400.0)] * 2}
    assert "| median_tpot_ms | 100.0 | 400.0 | 0.250 |" in pin_cost.report(runs)
