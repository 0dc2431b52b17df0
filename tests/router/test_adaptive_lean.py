"""The adaptive policy's lean loop (router/lean.py): the step model's verdict on the prompts of the last WINDOW_S
(and RETURN_WINDOW_S to go back), acted on at the next tick, one engine at a time, never every engine; and, through
AdaptivePolicy on a fake clock, how fast it follows a shifting load and how rarely it moves on a steady one."""

from __future__ import annotations

import heapq
import random

import pytest

from pdserve.router.adaptive import LEAN_DECODE, LEAN_NONE, LEAN_PREFILL
from pdserve.router.adaptive_policy import AdaptivePolicy
from pdserve.router.config import RouterConfig
from pdserve.router.lean import HOLD_S, RETURN_WINDOW_S, WINDOW_S, LeanController
from pdserve.router.step_model import StepModel
from tests.router.test_adaptive_policy import Link

ENGINES = ["a", "b", "c"]


def always(verdict):
    asked = []

    def split(rate: float, mean_prefill_s: float, num_prefill: int):
        asked.append((rate, mean_prefill_s, num_prefill))
        return verdict
    return split, asked


def test_the_verdict_reads_the_prompts_of_the_last_window():
    controller = LeanController(1.0)
    for when, prefill_s in [(0.0, 9.0), (5.0, 1.0), (6.0, 3.0)]:
        controller.observe(when, prefill_s)
    split, asked = always(None)
    assert controller.tick(WINDOW_S + 1.0, ENGINES, {}, split) == []
    assert asked == [pytest.approx((2 / WINDOW_S, 2.0, 0))]  # the prompt at 0 s left the window
    assert controller.tick(WINDOW_S + 6.0, ENGINES, {}, split) == [] and len(asked) == 1, "empty window: no verdict"


def test_a_clear_verdict_moves_one_engine_at_the_next_tick_and_one_never_leans():
    controller = LeanController(1.0)
    split, _ = always(LEAN_PREFILL)
    changes = []
    for second in range(60):
        controller.observe(float(second), 2.0)
        changes += controller.tick(float(second), ENGINES, {"a": 5, "b": 1, "c": 3}, split)
    assert [(c.address, c.new) for c in changes] == [("b", LEAN_PREFILL), ("c", LEAN_PREFILL)]
    assert changes and controller.lean("a") == LEAN_NONE, "the engine decoding most never leans"


def test_back_to_none_one_at_a_time_after_the_hold_and_no_lean_to_decode():
    controller = LeanController(1.0)
    controller.observe(0.0, 2.0)
    controller.tick(0.0, ENGINES, {}, always(LEAN_PREFILL)[0])
    controller.tick(1.0, ENGINES, {}, always(LEAN_PREFILL)[0])
    assert sorted(controller.leans) == ["a", "b"]
    back = always(LEAN_DECODE)[0]
    assert controller.tick(HOLD_S - 0.5, ENGINES, {}, back) == [], "a lean just given is held"
    changes = []
    for second in range(int(HOLD_S), int(HOLD_S) + 10):
        controller.observe(float(second), 0.1)
        changes += controller.tick(float(second), ENGINES, {}, back)
    assert [(c.address, c.new) for c in changes] == [("a", LEAN_NONE), ("b", LEAN_NONE)]
    assert controller.leans == {}


def test_one_engine_fewer_only_once_the_longer_window_agrees():
    """The last 8 s hold only short prompts, but a long one came within RETURN_WINDOW_S: the lean stays."""
    def by_mix(rate: float, mean_prefill_s: float, num_prefill: int):
        return LEAN_DECODE if mean_prefill_s < 1.0 else None
    controller = LeanController(1.0)
    controller.leans["a"] = LEAN_PREFILL
    controller.observe(0.0, 5.0)
    for second in (WINDOW_S + 1, WINDOW_S + 2):
        controller.observe(second, 0.1)
    assert controller.tick(WINDOW_S + 2, ENGINES, {}, by_mix) == []
    controller.observe(RETURN_WINDOW_S + 1, 0.1)
    assert [(c.address, c.new) for c in controller.tick(RETURN_WINDOW_S + 1, ENGINES, {}, by_mix)] == [("a", 0)]


def test_an_engine_that_left_loses_its_lean_and_one_engine_alone_never_leans():
    controller = LeanController(1.0)
    controller.observe(0.0, 2.0)
    controller.tick(0.0, ["a", "b"], {"a": 0, "b": 1}, always(LEAN_PREFILL)[0])
    controller.forget("a")
    assert controller.lean("a") == LEAN_NONE and "a" not in controller.leans
    alone = LeanController(1.0)
    for second in range(5):
        alone.observe(float(second), 5.0)
        assert alone.tick(float(second), ["a"], {}, always(LEAN_PREFILL)[0]) == []


def test_due_once_per_interval():
    controller = LeanController(2.0)
    assert not controller.due(10.0)
    assert not controller.due(11.9)
    assert controller.due(12.0)
    controller.tick(12.0, ENGINES, {}, always(None)[0])
    assert not controller.due(13.0)


# ---- through the policy: synthetic arrival streams on a fake clock ----

# the engines of the measured run (docs/results.md, adaptive prefill:decode, run 1): a 1,000-token prompt in about
# 1.9 s, a decode step of about 40 ms, and that run's SLOs
MACHINE = StepModel().scaled(prefill_ratio=0.5, decode_ratio=0.8)
STEP_S = 0.04
PREFILL_HEAVY = (1000, 48, 0.2)  # prompt tokens, output tokens, requests per second (issue #47's shifting load)
DECODE_HEAVY = (128, 256, 0.5)
REACTION_BOUND_S = 10.0  # after a switch to prefill-heavy load, no request is routed without the lean later than this
RETURN_BOUND_S = 40.0  # after the switch back, none is routed with it later than this
MAX_CHANGES_PER_MINUTE = 1.0  # on a steady mixed stream


def arrivals(phases, seed):
    """[(time, prompt tokens, output tokens)] of Poisson streams, one after another: phases of (seconds, kind),
    a kind being (prompt tokens, output tokens, rate) or a list of (weight, kind) drawn per request."""
    rng, start, stream = random.Random(seed), 0.0, []
    for seconds, kind in phases:
        rate = kind[2] if isinstance(kind, tuple) else sum(w * k[2] for w, k in kind)
        when = start + rng.expovariate(rate)
        while when < start + seconds:
            chosen = kind if isinstance(kind, tuple) else rng.choices([k for _, k in kind], [w for w, _ in kind])[0]
            stream.append((when, chosen[0], chosen[1]))
            when += rng.expovariate(rate)
        start += seconds
    return stream


def simulate(stream):
    """Route every arrival through AdaptivePolicy (lean ticks every 1 s); each routed request decodes on the engine
    chosen for it for its output tokens, one STEP_S step each, then teaches the horizon. Returns the lean changes
    as (time, engine, lean)."""
    policy = AdaptivePolicy(RouterConfig(model="m", served_model_name="m", routing="adaptive", slo_ttft_ms=7_680,
                                         slo_tpot_ms=79, adaptive_lean_interval_s=1.0), MACHINE)
    now = [0.0]
    policy.clock = lambda: now[0]
    engines = [Link("a"), Link("b")]
    finishes, changes, seen = [], [], {"a": LEAN_NONE, "b": LEAN_NONE}
    for index, (when, num_prompt, num_output) in enumerate(stream):
        while finishes and finishes[0][0] <= when:
            _, _, link, prompt, num_output_done, hashes = heapq.heappop(finishes)
            link.num_decoding -= 1
            link.decode_tokens -= len(prompt) + num_output_done
            policy.record_output(link, prompt + [0] * num_output_done, hashes)
        now[0] = when
        prompt = list(range(index * 2000, index * 2000 + num_prompt))
        route = policy.route(prompt, engines, engines)
        route.decode.num_decoding += 1
        route.decode.decode_tokens += num_prompt + num_output
        done = when + policy.model.prefill_s(num_prompt) + num_output * STEP_S
        heapq.heappush(finishes, (done, index, route.decode, prompt, num_output, route.prompt_hashes))
        for address in seen:
            if policy.lean_of(address) != seen[address]:
                seen[address] = policy.lean_of(address)
                changes.append((when, address, seen[address]))
    return changes


def leaning_at(changes, when):
    """Engines leaning to prefill when a request arriving at `when` is routed."""
    leans = {}
    for at, address, lean in changes:
        if at <= when:
            leans[address] = lean
    return sum(1 for lean in leans.values() if lean == LEAN_PREFILL)


@pytest.mark.parametrize("seed", range(4))
def test_the_lean_follows_a_shifting_load_within_its_bounds(seed):
    """Issue #47's shifting load, 60 s phases: in each phase after the first, the requests routed in the wrong state
    (no engine leaning during prefill-heavy load, one leaning during decode-heavy load) all come within the bound
    of the switch, and the lean changes once per switch at most."""
    phases = [(60.0, DECODE_HEAVY), (60.0, PREFILL_HEAVY)] * 3
    stream = arrivals(phases, seed)
    changes = simulate(stream)
    for phase in range(1, len(phases)):
        start, prefill_heavy = phase * 60.0, phase % 2 == 1
        wrong = [when for when, _, _ in stream
                 if start <= when < start + 60.0 and leaning_at(changes, when) != int(prefill_heavy)]
        bound = REACTION_BOUND_S if prefill_heavy else RETURN_BOUND_S
        assert all(when - start <= bound for when in wrong), (phase, wrong, changes)
    assert len(changes) <= len(phases) - 1, changes
    assert all(lean != LEAN_DECODE for _, _, lean in changes)


@pytest.mark.parametrize("seed", range(4))
def test_a_steady_mixed_stream_moves_the_lean_rarely(seed):
    minutes = 10
    mixed = [(0.3, PREFILL_HEAVY), (0.7, DECODE_HEAVY)]
    changes = simulate(arrivals([(minutes * 60.0, mixed)], seed))
    assert len(changes) <= MAX_CHANGES_PER_MINUTE * minutes, changes


@pytest.mark.parametrize("kind", [PREFILL_HEAVY, DECODE_HEAVY])
def test_a_steady_load_of_one_kind_moves_the_lean_at_most_once(kind):
    changes = simulate(arrivals([(300.0, kind)], 7))
    assert len(changes) <= 1, changes
    assert leaning_at(changes, 300.0) == (1 if kind is PREFILL_HEAVY else 0)
