"""How many dual-role engines lean to prefill (router/lean_split.py): the step model's worst ratio with k
prompt engines against k + 1 and k - 1, on the two loads of issue #47 and at the boundary."""

from __future__ import annotations

import math

import pytest

from pdserve.router.adaptive import LEAN_DECODE, LEAN_PREFILL, Slo
from pdserve.router.lean_split import SplitWork, poisson_quantile, predicted_ratio, split_verdict
from pdserve.router.step_model import StepModel

MODEL = StepModel()
PREFILL_HEAVY = SplitWork(num_engines=2, prompt_rate=0.16, mean_prefill_s=MODEL.prefill_s(1000), num_decoding=8,
                          decode_context_tokens=8 * 1024, horizon_tokens=48)
PREFILL_HEAVY_SLO = Slo(ttft_s=14.4, tpot_s=0.09)
DECODE_HEAVY = SplitWork(num_engines=2, prompt_rate=0.5, mean_prefill_s=MODEL.prefill_s(128), num_decoding=16,
                         decode_context_tokens=16 * 256, horizon_tokens=256)
DECODE_HEAVY_SLO = Slo(ttft_s=1.9, tpot_s=0.147)


def test_long_prompts_beside_running_decodes_call_for_a_prefill_engine():
    colocated = predicted_ratio(PREFILL_HEAVY, 0, MODEL, PREFILL_HEAVY_SLO)
    dedicated = predicted_ratio(PREFILL_HEAVY, 1, MODEL, PREFILL_HEAVY_SLO)
    # colocated: the 90th percentile decode is stalled by one 3.7 s prefill spread over its 48 tokens
    step = MODEL.decode_s(4, 4 * 1024)
    assert colocated == pytest.approx((step + PREFILL_HEAVY.mean_prefill_s / 48) / 0.09)
    assert dedicated < colocated * 0.9
    assert split_verdict(PREFILL_HEAVY, 0, MODEL, PREFILL_HEAVY_SLO) == LEAN_PREFILL
    assert split_verdict(PREFILL_HEAVY, 1, MODEL, PREFILL_HEAVY_SLO) is None  # no third engine to give


def test_short_prompts_and_long_answers_call_every_engine_back_to_decoding():
    assert split_verdict(DECODE_HEAVY, 1, MODEL, DECODE_HEAVY_SLO) == LEAN_DECODE
    assert split_verdict(DECODE_HEAVY, 0, MODEL, DECODE_HEAVY_SLO) is None


def test_prompts_beyond_what_the_prompt_engines_can_carry_keep_them_spread():
    flood = SplitWork(2, prompt_rate=0.5, mean_prefill_s=MODEL.prefill_s(1000), num_decoding=2,
                      decode_context_tokens=2048, horizon_tokens=48)  # 1.9 engines' worth of prompts
    assert predicted_ratio(flood, 1, MODEL, PREFILL_HEAVY_SLO) > predicted_ratio(flood, 0, MODEL, PREFILL_HEAVY_SLO)
    assert split_verdict(flood, 0, MODEL, PREFILL_HEAVY_SLO) is None
    assert predicted_ratio(flood, 2, MODEL, PREFILL_HEAVY_SLO) == math.inf  # nobody left to decode


def test_poisson_quantile():
    assert [poisson_quantile(mean, 0.9) for mean in (0.0, 0.05, 0.31, 1.0, 5.8)] == [0, 0, 1, 2, 9]
    assert poisson_quantile(100.0, 0.9) == math.ceil(100 + 12.816)


def test_a_prefill_leaning_engine_takes_no_decode_while_another_can():
    from pdserve.router.adaptive import EngineLoad, choose
    engines = [EngineLoad("x", True, True, 1000, num_decoding=0, lean=LEAN_PREFILL),
               EngineLoad("y", True, True, 1000, num_decoding=6, decode_context_tokens=6000)]
    choice = choose(1000, engines, MODEL, PREFILL_HEAVY_SLO, 48)
    assert (choice.prefill, choice.decode) == ("x", "y")  # x prefills, y decodes: never colocated on x
    short = choose(16, engines, MODEL, PREFILL_HEAVY_SLO, 48, allow_remote_prefill=False)
    assert short.decode == "y" and short.local
    alone = choose(16, engines[:1], MODEL, PREFILL_HEAVY_SLO, 48)
    assert alone.decode == "x"  # the only engine decodes, leaning or not


def test_a_split_far_within_the_slos_stays_whatever_the_relative_gain():
    loose = Slo(ttft_s=PREFILL_HEAVY_SLO.ttft_s * 100, tpot_s=PREFILL_HEAVY_SLO.tpot_s * 100)
    assert predicted_ratio(PREFILL_HEAVY, 1, MODEL, loose) < 0.9 * predicted_ratio(PREFILL_HEAVY, 0, MODEL, loose)
    assert split_verdict(PREFILL_HEAVY, 0, MODEL, loose) is None
