"""The co-run factor: decode steps that start while another engine of the cluster computes a prompt are slower by
the profile's factor, in closed form; nothing changes without such overlap; profiles without it read as 1.0."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from pdserve.planner.profile.corun import paired_ratios, round_order
from pdserve.planner.profile.corun_fit import MIN_FACTOR, NO_CORUN, CoRun, bounded_least_squares, corun_terms
from pdserve.planner.profile.fit import DecodePoint, model_identity
from pdserve.planner.model.host_effects import NO_HOST_EFFECTS, HostEffects, host_effects
from pdserve.planner.model.simulator import ClusterSpec, simulate, simulate_tiers
from tests.planner.helpers import synthetic_profile
from pdserve.planner.model.workload import random_workload
from tests.planner.test_simulator import model


S, PREFILL, FACTOR = 0.1, 1.0, 1.5  # seconds per decode step and per prefill step; the slow-down


def two_requests(spec: ClusterSpec, effects: HostEffects):
    """A (40 tokens out) at 0.0 and B (3 out) at 1.55, 16-token prompts, constant steps: S per decode step,
    PREFILL per prompt."""
    cost = model(prefill_intercept=PREFILL, decode_intercept=S)
    return simulate(spec, cost, [0.0, 1.55], [16, 16], [40, 3], effects=effects)


def test_decode_steps_beside_another_engines_prefill_are_slower_by_the_factor():
    # 1P1D, constant steps: s per decode step, P per prefill step, no transfer time. A's prompt is done at P and
    # it decodes from there. B arrives at 1.55: the prefill engine computes it over [1.55, 2.55]. A's step under
    # way at 1.55 (from 1.5) keeps its time; the steps starting at 1.6 .. 2.5 take f * s; from 2.65 on s again.
    s, prefill, factor = S, PREFILL, FACTOR
    a, b = two_requests(ClusterSpec(1, 1), HostEffects(corun=CoRun.uniform(factor)))
    normal_steps, slowed_steps = 6 + 26, 7  # 39 steps make A's 40 tokens after its first
    assert a.first_token == pytest.approx(prefill)
    assert a.finish == pytest.approx(prefill + normal_steps * s + slowed_steps * factor * s)
    assert b.first_token == pytest.approx(1.55 + prefill)  # a prefill step is not slowed by decodes
    assert b.second_token == pytest.approx(prefill + 6 * s + 7 * factor * s + s)  # joins at 2.65, after A's step
    alone_a, _ = two_requests(ClusterSpec(1, 1), HostEffects(corun=CoRun.uniform(1.0)))
    assert alone_a.finish == pytest.approx(prefill + 39 * s)


def test_a_decode_run_is_retimed_when_an_engine_it_does_not_serve_starts_or_ends_a_prefill():
    # 1P2D, round robin: A decodes on the first decode engine, B goes to the second. Only the prefill engine's
    # start (1.55) and end (2.55) of B's prompt reach A's engine, and its run changes speed at the next boundary.
    s, prefill, factor = S, PREFILL, FACTOR
    a, b = two_requests(ClusterSpec(1, 2, decode_policy="round_robin"), HostEffects(corun=CoRun.uniform(factor)))
    assert a.decode_engine is not b.decode_engine
    assert a.finish == pytest.approx(prefill + (6 + 26) * s + 7 * factor * s)


def test_decode_steps_beside_another_engines_decode_steps_are_slower_by_that_factor():
    # 0P2D, round robin, constant steps: A decodes on engine 0 from 1.0 (steps of s). B's prompt runs on engine 1
    # over [1.55, 2.55] (no factor for prompts here); B then decodes two steps beside A, each f * s: 2.55-2.70-2.85.
    # A's step under way at 2.55 (from 2.5) keeps its time; the two starting at 2.6 and 2.75 (B decodes then) take
    # f * s; B is done at 2.85, so from A's next boundary (2.9) on, s again.
    s, prefill, factor = S, PREFILL, FACTOR
    beside = HostEffects(beside_decode=CoRun.uniform(factor))
    a, b = two_requests(ClusterSpec(0, 2, decode_policy="round_robin"), beside)
    assert a.decode_engine is not b.decode_engine
    assert b.first_token == pytest.approx(2.55)
    assert b.finish == pytest.approx(2.55 + 2 * factor * s)
    assert a.finish == pytest.approx(prefill + 37 * s + 2 * factor * s)
    # B's prompt slows A too, by the other factor: 8 steps of 1.2 s from 1.6 to 2.56, then 2 of f * s to 2.86
    both = HostEffects(corun=CoRun.uniform(1.2), beside_decode=CoRun.uniform(factor))
    a_both, _ = two_requests(ClusterSpec(0, 2, decode_policy="round_robin"), both)
    assert a_both.finish == pytest.approx(prefill + 29 * s + 8 * 1.2 * s + 2 * factor * s)


def test_the_factor_slows_only_the_decode_part_of_a_mixed_step():
    cost = model(decode_intercept=0.05, decode_per_seq=0.01, decode_per_context=1e-5, prefill_per_token=1e-3)
    decode = 0.05 + 0.01 * 3 + 1e-5 * 600
    chunks = 1e-3 * 128
    assert cost.step_seconds(3, 600, 128, 0.0) == pytest.approx(decode + chunks)
    assert cost.step_seconds(3, 600, 128, 0.0, slowdown=CoRun.uniform(1.4)) == pytest.approx(1.4 * decode + chunks)
    assert cost.step_seconds(0, 0, 128, 0.0, slowdown=CoRun.uniform(1.4)) == cost.step_seconds(0, 0, 128, 0.0)  # prefill-only step


@pytest.mark.parametrize("spec, arrivals", [
    (ClusterSpec(1, 1), [0.0, 10.0, 20.0]),  # each request decodes after its prompt, alone on the host
    (ClusterSpec(0, 1), [0.0, 0.05, 0.3]),  # one engine: no other engine beside it
])
def test_without_overlap_the_factor_changes_nothing(spec, arrivals):
    cost = model(prefill_intercept=0.3, prefill_per_token=1e-4, decode_intercept=0.05, decode_per_seq=1e-3,
                 transfer_latency=0.01, transfer_per_byte=1e-9)
    plain = simulate(spec, cost, arrivals, [200, 100, 300], [20, 30, 10])
    slowed = simulate(spec, cost, arrivals, [200, 100, 300], [20, 30, 10], effects=HostEffects(corun=CoRun.uniform(2.0)))
    assert [(r.first_token, r.second_token, r.finish) for r in slowed] == \
        [(r.first_token, r.second_token, r.finish) for r in plain]


def test_one_engine_per_tier_leaves_the_factor_out():
    cost, corun = model(prefill_intercept=0.3, decode_intercept=0.05), HostEffects(corun=CoRun.uniform(1.5))
    args = ([0.0, 0.1, 0.2, 0.4], [100] * 4, [30] * 4)
    overlapped = simulate(ClusterSpec(1, 1), cost, *args, effects=corun)
    tiers = simulate_tiers(ClusterSpec(1, 1), cost, *args, effects=corun)
    plain = simulate(ClusterSpec(1, 1), cost, *args)
    assert [r.finish for r in tiers] == pytest.approx([r.finish for r in plain])
    assert overlapped[0].finish > plain[0].finish  # the whole cluster charges it


def test_a_profile_without_the_factor_reads_as_one(model_factory):
    profile = synthetic_profile(model_identity(model_factory()))
    assert "decode_corun" not in profile.machine
    assert profile.decode_corun == profile.decode_beside_decode == NO_CORUN
    effects = host_effects(plan_flags(), profile)
    assert effects.corun == effects.beside_decode == NO_CORUN
    measured = profile.model_copy(update={"machine": {**profile.machine, "decode_corun": {
        "factor": 1.1, "beside_decode": {"factor": 1.25}}}})  # before the split: one factor for the whole step
    effects = host_effects(plan_flags(), measured)
    assert (effects.corun, effects.beside_decode) == (CoRun.uniform(1.1), CoRun.uniform(1.25))
    measured = profile.model_copy(update={"machine": {**profile.machine, "decode_corun": {"factor": 1.25}}})
    assert host_effects(plan_flags(step_scale=(1.0, 2.0)), measured).corun == CoRun.uniform(1.25)


def test_a_gpu_profile_gets_no_host_effects_and_refuses_their_flags(model_factory):
    profile = synthetic_profile(model_identity(model_factory()))
    gpu = profile.model_copy(update={"machine": {**profile.machine, "device": "cuda",
                                                 "decode_corun": {"factor": 1.3}}})
    assert host_effects(plan_flags(), gpu) == NO_HOST_EFFECTS
    assert host_effects(plan_flags(no_host_effects=True), profile) == NO_HOST_EFFECTS
    with pytest.raises(ValueError, match="--step-scale: a CPU host's effects, and the profile is a GPU's"):
        host_effects(plan_flags(step_scale=(1.0, 2.0)), gpu)
    with pytest.raises(ValueError, match="--host-cpu-per-token: .* --no-host-effects switches them off"):
        host_effects(plan_flags(no_host_effects=True, host_cpu_per_token=300.0), profile)


def plan_flags(**given) -> argparse.Namespace:
    """`pdserve plan`'s flags as parsed, with the host's left at their defaults unless given."""
    flags = {"step_scale": (1.0, 1.0), "per_point_speed": False, "host_cpu_per_token": None,
             "host_background_cpu": None, "host_cpu_from": None, "no_host_effects": False}
    return argparse.Namespace(**{**flags, **given})


def test_each_term_of_a_decode_step_takes_its_own_factor():
    # weights part 0.05 + 0.01 * 3 = 0.08 s, KV reads 1e-5 * 600 = 0.006 s
    cost = model(decode_intercept=0.05, decode_per_seq=0.01, decode_per_context=1e-5, prefill_per_token=1e-3)
    slowdown = CoRun(weights=1.1, kv_reads=2.0)
    assert cost.step_seconds(3, 600, 128, 0.0, slowdown) == pytest.approx(1.1 * 0.08 + 2.0 * 0.006 + 1e-3 * 128)
    assert cost.decode_seconds(3, 600, slowdown) == pytest.approx(1.1 * 0.08 + 2.0 * 0.006)


def test_a_decode_run_beside_a_prefill_grows_by_the_kv_factor():
    # 1P1D, no weights part: each step of A costs c * context. B's prompt (1 s, [1.0, 2.0]) is computed on the
    # prefill engine while A decodes alone on the other: with the KV factor k every step that starts then reads
    # k times as slowly, and the factor for the weights part (none here) changes nothing.
    c, k = 1e-3, 1.5
    cost = model(prefill_intercept=1.0, decode_per_context=c)
    a, _ = simulate(ClusterSpec(1, 1), cost, [0.0, 1.0], [100, 16], [6, 2],
                    effects=HostEffects(corun=CoRun(weights=5.0, kv_reads=k)))
    a_plain, _ = simulate(ClusterSpec(1, 1), cost, [0.0, 1.0], [100, 16], [6, 2])
    # A's prompt is done at 1.0, B's runs over [1.0, 2.0]: A's 5 steps over contexts 101..105 all start (and end,
    # at 1.77) while B's prompt is computed, one run whose steps each read one more token
    steps = [c * (101 + i) for i in range(5)]
    assert a_plain.finish == pytest.approx(1.0 + sum(steps))
    assert a.finish == pytest.approx(1.0 + k * sum(steps))


@pytest.mark.parametrize("weights, kv_reads", [(1.0, 1.0), (1.05, 1.6), (0.97, 1.25), (1.3, 1.3)])
def test_the_split_recovers_known_factors_from_short_and_long_contexts(weights, kv_reads):
    # three shapes on a fit with 0.05 s + 0.003 s per sequence + 1.5e-5 s per context token (the demo model's)
    per_context = 1.5e-5
    rows = {}
    for batch, prompt in ((1, 16), (8, 16), (2, 1000)):
        context = batch * (prompt + 12)
        kv = per_context * context
        alone = 0.05 + 0.003 * batch + kv
        corun = weights * (alone - kv) + kv_reads * kv
        rows[f"{batch}x{prompt}"] = {"batch": batch, "context": context, "alone_cpu_s": alone, "corun_cpu_s": corun,
                                     "cpu_ratio": corun / alone}
    factors = corun_terms({"factor": 1.0, "batches": rows}, per_context)
    assert factors.weights == pytest.approx(weights)
    assert factors.kv_reads == pytest.approx(kv_reads)


def test_without_a_long_context_the_split_is_the_mean_ratio():
    rows = {f"{b}x16": {"batch": b, "context": b * 28, "alone_cpu_s": 0.06, "corun_cpu_s": 0.06 * r, "cpu_ratio": r}
            for b, r in ((1, 1.1), (8, 1.3))}
    assert corun_terms({"factor": 1.2, "batches": rows}, 1.5e-5) == CoRun.uniform(pytest.approx(1.2))
    assert corun_terms(None, 1.5e-5) == NO_CORUN
    assert corun_terms({"factor": 1.0, "skipped": "--no-corun"}, 1.5e-5) == NO_CORUN


@pytest.mark.parametrize("spec", [ClusterSpec(0, 2, decode_policy="least_kv"), ClusterSpec(1, 2, decode_policy="least_kv")])
def test_cutting_decode_runs_changes_no_routing(spec):
    """A factor of 1 + 1e-12 only makes the simulator cut decode runs wherever another engine starts or ends a kind
    of step. The router's least_kv reads each engine's KV in use at the arrival, mid-run included, so the cuts
    change nothing. (It read the KV as of the run's start, stale by up to a whole run, and sent requests
    elsewhere depending on where runs happened to be cut.)"""
    cost = model(prefill_intercept=0.02, prefill_per_token=2.5e-3, decode_intercept=0.05, decode_per_seq=3e-3,
                 decode_per_context=1.5e-5)
    workload = random_workload(60, 128, 256, range_ratio=0.5, seed=7)
    arrivals = workload.arrivals(0.5, seed=7)
    plain = simulate(spec, cost, arrivals, workload.prompt_lens, workload.output_lens)
    cut = simulate(spec, cost, arrivals, workload.prompt_lens, workload.output_lens,
                   effects=HostEffects(corun=CoRun.uniform(1 + 1e-12), beside_decode=CoRun.uniform(1 + 1e-12)))
    assert [r.decode_engine.index for r in cut] == [r.decode_engine.index for r in plain]
    assert [r.finish for r in cut] == pytest.approx([r.finish for r in plain], rel=1e-9)


def test_each_round_is_compared_with_its_own_alone_pass():
    # three rounds; in the last the machine stalled while the neighbour ran: the ratio of the medians would read
    # x1.47, the rounds' own ratios say x1.1 twice and x1.6 once
    def points(seconds: list[float]) -> list[DecodePoint]:
        return [DecodePoint(batch=2, context=56, longest=28, seconds=s, cpu_seconds=s) for s in seconds]

    measured = paired_ratios({"2x20": points([1.0, 2.0, 1.5])}, {"2x20": points([1.1, 2.2, 2.4])})
    row = measured["batches"]["2x20"]
    assert row["cpu_round_ratios"] == pytest.approx([1.1, 1.1, 1.6])
    assert row["cpu_ratio"] == row["wall_ratio"] == pytest.approx(1.1)
    assert (row["alone_cpu_s"], row["corun_cpu_s"]) == (1.5, 2.2)
    assert measured["factor"] == pytest.approx(1.1)
    with pytest.raises(ValueError):  # a round without its pair is a bug in the caller, not a ratio
        paired_ratios({"2x20": points([1.0, 2.0])}, {"2x20": points([1.1])})


def test_every_other_round_runs_its_sides_in_reverse():
    sides = [None, "prefill", "decode"]
    assert [round_order(sides, i) for i in range(3)] == [sides, sides[::-1], sides]


def test_the_split_reads_the_paired_ratio_not_the_medians():
    # one shape per KV share; the medians say x2, the rounds' paired ratio x1.1: the factors follow the ratio
    rows = {key: {"batch": batch, "context": batch * (prompt + 8), "alone_cpu_s": 0.1, "corun_cpu_s": 0.2,
                  "cpu_ratio": 1.1, "cpu_round_ratios": [1.1, 1.1]}
            for key, (batch, prompt) in {"1x16": (1, 16), "2x1000": (2, 1000)}.items()}
    factors = corun_terms({"factor": 1.1, "batches": rows}, per_context=1.5e-5)
    assert factors.weights == pytest.approx(1.1) and factors.kv_reads == pytest.approx(1.1)


def test_noisy_short_shapes_do_not_fit_a_negative_factor():
    """Two short-context shapes whose KV shares differ by chance: unbounded, the split read weights 2.5 and KV
    reads -0.56 (a clean-clone CI run of profile --quick). Bounded, every factor is at least MIN_FACTOR and the
    fit still explains the ratios as well as a feasible fit can."""
    rows = {"1x16": {"batch": 1, "context": 28, "alone_cpu_s": 0.0020, "cpu_ratio": 1.30},
            "2x16": {"batch": 2, "context": 56, "alone_cpu_s": 0.0022, "cpu_ratio": 0.95}}
    factors = corun_terms({"factor": 1.1, "batches": rows}, per_context=1.5e-5)
    assert min(factors.weights, factors.kv_reads) >= MIN_FACTOR
    assert factors.kv_reads == pytest.approx(MIN_FACTOR)  # the term the noise pushed below the bound sits on it
    assert 1.0 < factors.weights < 1.5


def test_the_bounded_fit_is_the_plain_fit_when_that_is_feasible():
    terms = np.array([[0.9, 0.1], [0.5, 0.5], [0.2, 0.8]])
    target = terms @ np.array([0.05, 0.6])
    assert bounded_least_squares(terms, target, lower=-0.1) == pytest.approx((0.05, 0.6))
    assert bounded_least_squares(terms, target, lower=0.1) == pytest.approx((0.1, 0.6), abs=0.05)
