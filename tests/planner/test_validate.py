"""replay.goodput_agreement: whether the split `pdserve plan` would recommend is the one a sweep measured best."""

from __future__ import annotations

from pdserve.planner.validate.replay import goodput_agreement

SLOS = {"ttft": 1000.0, "tpot": 100.0}


def point(config: str, rate: float, measured: float, predicted: float) -> dict:
    return {"config": config, "num_prefill": int(config.split("P")[0]), "num_engines": 2, "slos_ms": SLOS,
            "request_rate": rate, "measured_slo_attainment": measured, "predicted_slo_attainment": predicted}


def agreement(points: list[dict]) -> dict:
    [group] = goodput_agreement(points)
    return group


def test_a_decisive_sweep_agrees_when_the_prediction_picks_its_best():
    group = agreement([point("0P2D", 1, 1.0, 1.0), point("0P2D", 2, 0.5, 0.95),
                       point("1P1D", 1, 0.95, 0.9), point("1P1D", 2, 0.92, 1.0)])
    assert group["measured"] == {"0P2D": 1, "1P1D": 2} and group["predicted"] == {"0P2D": 2, "1P1D": 2}
    # A tie in the prediction goes to fewer prefill engines, as recommend.recommend breaks it.
    assert group["decisive"] and group["measured_best"] == "1P1D" and group["predicted_best"] == "0P2D"
    assert not group["agrees"]
    group = agreement([point("0P2D", 1, 1.0, 1.0), point("0P2D", 2, 0.5, 0.5),
                       point("1P1D", 1, 0.95, 0.9), point("1P1D", 2, 0.92, 1.0)])
    assert group["predicted_best"] == "1P1D" and group["agrees"]


def test_a_prediction_of_no_goodput_recommends_nothing():
    # Both configs predicted below 90% everywhere: `plan` has no split to recommend, so a decisive sweep is missed.
    group = agreement([point("0P2D", 0.1, 0.7, 0.5), point("1P1D", 0.1, 1.0, 0.8)])
    assert group["decisive"] and group["measured_best"] == "1P1D"
    assert group["predicted_best"] is None and not group["agrees"]


def test_a_sweep_without_a_decisive_best_does_not_judge_the_recommendation():
    group = agreement([point("0P2D", 1, 0.95, 0.0), point("1P1D", 1, 0.91, 0.95)])
    assert not group["decisive"] and group["agrees"]
    group = agreement([point("0P2D", 1, 0.5, 0.95), point("1P1D", 1, 0.2, 0.0)])
    assert group["measured_best"] is None and not group["decisive"] and group["agrees"]
