"""The adaptive policy's lean loop (router/lean.py): one engine per interval, only after the pressure held for
CONFIRM_TICKS intervals, never back before DWELL_TICKS, never every engine."""

from __future__ import annotations

from pdserve.router.adaptive import LEAN_DECODE, LEAN_NONE, LEAN_PREFILL, Choice
from pdserve.router.lean import CONFIRM_TICKS, DWELL_TICKS, MARGIN, LeanController

ENGINES = ["a", "b", "c"]


def pressure(ttft_ratio: float, tpot_ratio: float) -> Choice:
    return Choice(prefill=None, decode="a", ttft_s=0.0, tpot_s=0.0, worst_ratio=max(ttft_ratio, tpot_ratio), harm=0.0,
                  ttft_ratio=ttft_ratio, tpot_ratio=tpot_ratio)


def run(controller: LeanController, ticks: list[tuple[float, float]], decoding: dict | None = None) -> list:
    """Each interval: ten requests at (ttft, tpot) pressure, then a tick; every change made, in order."""
    changes = []
    for index, (ttft, tpot) in enumerate(ticks):
        for _ in range(10):
            controller.observe(pressure(ttft, tpot))
        changes += controller.tick(float(index), ENGINES, decoding or {"a": 5, "b": 1, "c": 3})
    return changes


def test_ttft_pressure_turns_the_engine_decoding_least_to_prefill_after_confirmation():
    controller = LeanController(1.0)
    changes = run(controller, [(1.5, 0.6)] * CONFIRM_TICKS)
    assert [(c.address, c.new) for c in changes] == [("b", LEAN_PREFILL)]
    assert controller.lean("b") == LEAN_PREFILL and controller.lean("a") == LEAN_NONE


def test_tpot_pressure_turns_the_engine_decoding_most_to_decode():
    controller = LeanController(1.0)
    changes = run(controller, [(0.6, 1.5)] * CONFIRM_TICKS)
    assert [(c.address, c.new) for c in changes] == [("a", LEAN_DECODE)]


def test_at_most_one_change_per_confirmation_and_one_engine_never_leans():
    controller = LeanController(1.0)
    changes = run(controller, [(1.5, 0.6)] * (10 * CONFIRM_TICKS))
    assert len(changes) == len(ENGINES) - 1
    assert sum(1 for engine in ENGINES if controller.lean(engine) == LEAN_NONE) == 1


def test_pressure_that_flips_every_interval_moves_nothing():
    controller = LeanController(1.0)
    assert run(controller, [(1.5, 0.6), (0.6, 1.5)] * 10) == []


def test_pressures_within_the_margin_or_under_the_floor_move_nothing():
    controller = LeanController(1.0)
    assert run(controller, [(1.0, 1.0 + MARGIN * 0.9)] * 10) == []
    assert run(controller, [(0.3, 0.05)] * 10) == [], "far within the SLOs: no pressure either way"


def test_a_lean_is_kept_for_the_dwell_time_then_relaxes_without_pressure():
    controller = LeanController(1.0)
    run(controller, [(1.5, 0.6)] * CONFIRM_TICKS)
    assert controller.lean("b") == LEAN_PREFILL
    changes = run(controller, [(0.6, 1.5)] * (DWELL_TICKS - 1))
    assert all(change.address != "b" for change in changes), "b keeps its lean for DWELL_TICKS intervals"
    controller = LeanController(1.0)
    run(controller, [(1.5, 0.6)] * CONFIRM_TICKS)
    changes = run(controller, [(0.1, 0.1)] * (DWELL_TICKS + CONFIRM_TICKS))
    assert [(c.address, c.new) for c in changes] == [("b", LEAN_NONE)]


def test_an_engine_that_left_loses_its_lean_and_one_engine_alone_never_leans():
    controller = LeanController(1.0)
    run(controller, [(1.5, 0.6)] * CONFIRM_TICKS)
    controller.forget("b")
    assert controller.lean("b") == LEAN_NONE and "b" not in controller.leans
    alone = LeanController(1.0)
    for index in range(5):
        alone.observe(pressure(2.0, 0.1))
        assert alone.tick(float(index), ["a"], {}) == []


def test_due_once_per_interval():
    controller = LeanController(2.0)
    assert not controller.due(10.0)
    assert not controller.due(11.9)
    assert controller.due(12.0)
    controller.tick(12.0, ENGINES, {})
    assert not controller.due(13.0)
