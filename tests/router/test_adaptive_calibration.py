"""The step model scaled to the engines' reported step times (router/step_model.py's speed_ratios / calibrated):
measured over predicted for the same steps, bounded, and what the adaptive policy predicts with."""

from __future__ import annotations

import pytest

from pdserve.control.errors import ProtocolError
from pdserve.control.messages import EngineStats, StepTimes
from pdserve.router.adaptive import LEAN_PREFILL, Slo
from pdserve.router.lean_split import SplitWork, split_verdict
from pdserve.router.step_model import MAX_SPEED_RATIO, MIN_SPEED_RATIO, MIN_STEPS, StepModel, calibrated, speed_ratios
from tests.router.test_adaptive_policy import Link, adaptive

MODEL = StepModel()


def measured(decode_ratio: float, prefill_ratio: float, steps: float = 50.0) -> StepTimes:
    """Step times of an engine whose decode steps take decode_ratio times the model's prediction and whose prompt
    steps prefill_ratio times (their riding decodes at decode_ratio): 16 sequences of 300 tokens per decode step,
    a 512-token chunk after 512 computed beside 4 decodes per prompt step."""
    decode_s = MODEL.decode_s(16, 16 * 300) * decode_ratio
    prompt_s = (MODEL.prefill_intercept + MODEL.prefill_per_token * 512 + MODEL.prefill_attention * (1024**2 - 512**2)
                ) * prefill_ratio + MODEL.decode_part_s(4, 4 * 300) * decode_ratio
    return StepTimes(decode_seconds=steps * decode_s, decode_steps=steps, decode_seqs=steps * 16,
                     decode_context_tokens=steps * 16 * 300, prompt_seconds=steps * prompt_s, prompt_steps=steps,
                     prompt_tokens=steps * 512, prompt_squares=steps * (1024**2 - 512**2),
                     prompt_decode_seqs=steps * 4, prompt_decode_context_tokens=steps * 4 * 300)


def test_measured_over_predicted_for_each_kind_of_step():
    assert speed_ratios(MODEL, [measured(2.0, 0.5)]) == pytest.approx((0.5, 2.0))
    assert speed_ratios(MODEL, [measured(3.0, 3.0), measured(1.0, 1.0)]) == pytest.approx((2.0, 2.0)), \
        "summed over engines: the cluster's speed"
    slow = calibrated(MODEL, [measured(3.0, 1.5)])
    assert slow.decode_s(8, 2000) == pytest.approx(3.0 * MODEL.decode_s(8, 2000))
    assert slow.prefill_s(1000) == pytest.approx(1.5 * MODEL.prefill_s(1000))
    assert slow.transfer_s(1000) == MODEL.transfer_s(1000)


def test_ratios_are_bounded_and_need_a_few_steps_of_evidence():
    assert speed_ratios(MODEL, [measured(100.0, 100.0)]) == (MAX_SPEED_RATIO, MAX_SPEED_RATIO)
    assert speed_ratios(MODEL, [measured(0.001, 0.001)]) == (MIN_SPEED_RATIO, MIN_SPEED_RATIO)
    assert speed_ratios(MODEL, [measured(2.0, 2.0, steps=MIN_STEPS - 1)]) == (1.0, 1.0)
    assert speed_ratios(MODEL, [StepTimes()]) == (1.0, 1.0) and calibrated(MODEL, []) is MODEL


def test_a_peer_cannot_report_a_negative_or_infinite_time():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ProtocolError, match="step_times.decode_seconds"):
            EngineStats(engine_id="e", role="dual", num_waiting=0, num_running=0, kv_blocks_used=0, kv_blocks_total=1,
                        queued_prefill_tokens=0, step_times={"decode_seconds": bad})


def reporting(link: Link, times: StepTimes) -> Link:
    link.stats = link.stats.model_copy(update={"step_times": times})
    return link


def test_the_policy_predicts_with_the_engines_measured_speed():
    """Decodes measured 3x slower than the built-in profile: one more decode beside 12 running is predicted over a
    150 ms TPOT SLO (within it at the profile's speed), and the model is made again only when a report changes."""
    policy = adaptive(slo_ttft_ms=20_000, slo_tpot_ms=150)
    busy = reporting(Link("a", num_decoding=12, decode_tokens=12 * 200), measured(3.0, 1.0))
    idle = reporting(Link("b"), measured(3.0, 1.0))
    model = policy.calibrated_model([busy, idle])
    assert model.decode_s(13, 2400) == pytest.approx(3 * MODEL.decode_s(13, 2400))
    assert MODEL.decode_s(13, 2400) < 0.15 < model.decode_s(13, 2400)
    assert policy.calibrated_model([busy, idle]) is model
    reporting(busy, measured(1.0, 1.0))
    reporting(idle, measured(1.0, 1.0))
    assert policy.calibrated_model([busy, idle]).decode_s(13, 2400) == pytest.approx(MODEL.decode_s(13, 2400))


def test_measured_speed_changes_the_lean_verdict():
    """Issue #47's prefill-heavy load: at the profile's speed one engine should lean to prefill; measured prompt
    steps twice as slow, one prefill engine cannot carry the prompts within the TTFT SLO, and the engines stay
    colocated; twice as fast, the stalls are short enough that they stay colocated too."""
    slo = Slo(ttft_s=14.4, tpot_s=0.09)

    def verdict(model: StepModel):
        work = SplitWork(num_engines=2, prompt_rate=0.16, mean_prefill_s=model.prefill_s(1000), num_decoding=8,
                         decode_context_tokens=8 * 1024, horizon_tokens=48)
        return split_verdict(work, 0, model, slo)
    assert verdict(calibrated(MODEL, [measured(1.0, 1.0)])) == LEAN_PREFILL
    assert verdict(calibrated(MODEL, [measured(1.0, 2.0)])) is None
    assert verdict(calibrated(MODEL, [measured(1.0, 0.5)])) is None
