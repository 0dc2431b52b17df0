"""The adaptive policy's choice (router/adaptive.py) on synthetic engine states, checked against the step model's
own predictions: the pair chosen is the one with the best predicted score among every (prefill, decode) pair."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pdserve.router.adaptive import LEAN_DECODE, LEAN_PREFILL, EngineLoad, Slo, choose, evaluate, score
from pdserve.router.step_model import StepModel, load_step_model

MODEL = StepModel()  # the CPU demo model's figures: a 1,000-token prompt takes ~3.7 s
SLO = Slo(ttft_s=8.0, tpot_s=0.3)
HORIZON = 64.0


def dual(address: str, prompt: int, *, decoding: int = 0, context: int = 0, queued: int = 0, **rest) -> EngineLoad:
    return EngineLoad(address=address, can_prefill=True, can_decode=True, uncached_tokens=prompt,
                      num_decoding=decoding, decode_context_tokens=context, queued_prefill_tokens=queued,
                      queued_prefill_squares=float(queued) ** 2, num_queued_prompts=1 if queued else 0, **rest)


def best_by_brute_force(prompt: int, engines: list[EngineLoad]) -> tuple:
    """The score of the best of every pair (P may equal D: colocated), from the model's predictions."""
    pairs = [(p, d) for p, d in itertools.product(engines, engines) if d.can_decode and (p.can_prefill or p is d)]
    return min(score(evaluate(p, d, prompt, MODEL, SLO, HORIZON)) for p, d in pairs)


def prefilled_on(choice) -> str:
    return choice.prefill or choice.decode


def test_long_prompt_with_decodes_everywhere_goes_to_the_least_interfering_prefill():
    engines = [dual("a", 1000, decoding=8, context=8 * 300), dual("b", 1000, decoding=2, context=2 * 300),
               dual("c", 1000, decoding=5, context=5 * 300)]
    choice = choose(1000, engines, MODEL, SLO, HORIZON)
    assert prefilled_on(choice) == "b", "its prefill stalls 2 decodes there, against 5 or 8 elsewhere"
    assert score(choice) == best_by_brute_force(1000, engines)
    on_a = evaluate(engines[0], engines[0], 1000, MODEL, SLO, HORIZON)
    assert choice.harm < on_a.harm and choice.tpot_ratio < on_a.tpot_ratio


def test_long_prompt_prefills_where_decodes_are_few_and_decodes_where_the_step_is_cheap():
    """One long-context decode on a, two short ones on b: the prefill stalls fewer decodes on a, and the new
    request's decode steps are cheaper on b: disaggregated, a -> b."""
    engines = [dual("a", 1000, decoding=1, context=6000), dual("b", 1000, decoding=2, context=200)]
    choice = choose(1000, engines, MODEL, SLO, HORIZON)
    assert (choice.prefill, choice.decode) == ("a", "b")
    assert score(choice) == best_by_brute_force(1000, engines)


def test_short_prompt_colocates_when_the_decode_engine_has_headroom():
    engines = [dual("a", 32, decoding=4, context=4 * 200), dual("b", 32, decoding=4, context=4 * 200)]
    choice = choose(32, engines, MODEL, SLO, HORIZON)
    assert choice.local, "both engines decode: prefilling elsewhere only adds a KV transfer"
    assert choice.worst_ratio < 1.0
    assert score(choice) == best_by_brute_force(32, engines)


def test_an_idle_prefill_engine_takes_a_long_prompt_off_a_busy_decode_engine():
    prefill = EngineLoad("p", can_prefill=True, can_decode=False, uncached_tokens=1000)
    decode = EngineLoad("d", can_prefill=False, can_decode=True, uncached_tokens=1000, num_decoding=6,
                        decode_context_tokens=1200)
    slo = Slo(ttft_s=8.0, tpot_s=0.1)
    choice = choose(1000, [prefill, decode], MODEL, slo, HORIZON)
    assert (choice.prefill, choice.decode) == ("p", "d")
    local = evaluate(decode, decode, 1000, MODEL, slo, HORIZON)
    assert local.tpot_ratio > 1.0, "the model predicts the local prefill stalls d's decodes past the TPOT SLO"
    assert choice.tpot_ratio < 1.0


def test_a_queued_prefill_engine_loses_to_local_prefill_when_ttft_binds():
    prefill = EngineLoad("p", can_prefill=True, can_decode=False, uncached_tokens=200, queued_prefill_tokens=3000,
                         queued_prefill_squares=3 * 1000.0 ** 2, num_queued_prompts=3)
    decode = EngineLoad("d", can_prefill=False, can_decode=True, uncached_tokens=200, num_decoding=1,
                        decode_context_tokens=100)
    choice = choose(200, [prefill, decode], MODEL, SLO, HORIZON)
    assert choice.local and choice.decode == "d"
    assert evaluate(prefill, decode, 200, MODEL, SLO, HORIZON).ttft_ratio > 1.0


def test_ties_are_broken_the_same_way_every_time():
    engines = [dual("b", 100), dual("a", 100), dual("c", 100)]
    choices = {choose(100, order, MODEL, SLO, HORIZON) for order in itertools.permutations(engines)}
    assert len(choices) == 1
    (choice,) = choices
    assert choice.local and choice.decode == "a", "idle and alike: colocated (no KV moves), the first address"


def test_no_engine_that_decodes_is_none():
    prefill_only = EngineLoad("p", can_prefill=True, can_decode=False, uncached_tokens=10)
    assert choose(10, [], MODEL, SLO, HORIZON) is None
    assert choose(10, [prefill_only], MODEL, SLO, HORIZON) is None


def test_remote_prefill_can_be_refused():
    prefill = EngineLoad("p", can_prefill=True, can_decode=False, uncached_tokens=1000)
    decode = EngineLoad("d", can_prefill=False, can_decode=True, uncached_tokens=1000, num_decoding=6)
    assert choose(1000, [prefill, decode], MODEL, SLO, HORIZON, allow_remote_prefill=False).local


def test_a_decode_engine_without_room_for_the_prompt_is_passed_over():
    full = dual("a", 500, kv_free_tokens=100)
    roomy = dual("b", 500, decoding=3, context=900)
    assert choose(500, [full, roomy], MODEL, SLO, HORIZON).decode == "b"
    assert choose(500, [full], MODEL, SLO, HORIZON).decode == "a", "when none has room: the best of them"


@pytest.mark.parametrize("prompt", [32, 1000])
def test_small_changes_in_load_do_not_flip_the_choice(prompt):
    engines = [dual("a", prompt, decoding=3, context=900), dual("b", prompt, decoding=6, context=1800)]
    first = choose(prompt, engines, MODEL, SLO, HORIZON)
    for extra in range(1, 40):  # a few more context tokens on the busier engine each time
        nudged = [engines[0], replace(engines[1], decode_context_tokens=1800 + extra)]
        again = choose(prompt, nudged, MODEL, SLO, HORIZON)
        assert (again.prefill, again.decode) == (first.prefill, first.decode)


def test_a_lean_biases_choices_that_meet_the_slos_alike():
    engines = [dual("a", 100), dual("b", 100)]
    assert choose(100, engines, MODEL, SLO, HORIZON).decode == "a"
    leaning = [replace(engines[0], lean=LEAN_PREFILL), replace(engines[1], lean=LEAN_DECODE)]
    choice = choose(100, leaning, MODEL, SLO, HORIZON)
    assert choice.decode == "b", "a leans to prefill: it takes no new decode while b can"
    assert choice.worst_ratio < 1.0


def test_the_pairs_searched_find_the_best_of_every_pair_over_many_states():
    """choose() evaluates the colocated choices and the two best engines per side; over random states its pick
    scores as well as the best of all pairs (the model's prediction)."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        prompt = rng.choice([16, 128, 512, 1000, 1800])
        engines = [dual(f"e{i}", prompt, decoding=(n := rng.randint(0, 12)), context=n * rng.randint(50, 1500),
                        queued=rng.choice([0, 0, 300, 1500])) for i in range(rng.randint(1, 5))]
        choice = choose(prompt, engines, MODEL, SLO, HORIZON)
        assert score(choice)[:2] <= best_by_brute_force(prompt, engines)[:2]


def test_the_step_model_reads_a_pdserve_profile(tmp_path):
    from pathlib import Path

    profile = Path(__file__).resolve().parents[1] / "planner" / "data" / "profile-cpu.json"
    model = load_step_model(profile)
    assert model.prefill_per_token == pytest.approx(0.003038854809909355)
    assert model.kv_bytes_per_token == 46080 and model.max_num_batched_tokens == 2048
    bad = tmp_path / "bad.json"
    bad.write_text('{"prefill_fit": {}}')
    with pytest.raises(ValueError, match="not a `pdserve profile` JSON"):
        load_step_model(bad)
    with pytest.raises(ValueError, match="cannot read it"):
        load_step_model(tmp_path / "missing.json")
