"""An engine's measured step times (engine/step_times.py): what each step prices, summed by kind with decay, and
EngineCore.stats() reporting them as EngineStats.step_times."""

from __future__ import annotations

import pytest

from pdserve.control.messages import EngineStats
from pdserve.control.protocol import decode, encode
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import SamplingParams
from pdserve.engine.step_times import WEIGHT, StepTimer


def test_a_prompt_in_chunks_sums_its_length_squared_and_decode_steps_their_context(model_factory):
    engine = EngineCore(ModelConfig.from_hf(model_factory("llama"), dtype="float32"), CacheConfig(4, 64),
                        SchedulerConfig(max_num_batched_tokens=16))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(engine.make_request("r", list(range(3, 43)), params))  # 40 tokens: chunks of 16, 16, 8
    while engine.has_work():
        engine.step()
    times = engine.stats().step_times
    keep = 1 - WEIGHT
    assert times.prompt_steps == pytest.approx(keep * keep + keep + 1)
    assert times.prompt_tokens == pytest.approx(16 * keep * keep + 16 * keep + 8)
    # (16^2 - 0) (32^2 - 16^2) (40^2 - 32^2) decayed: a whole prompt's 40^2 when nothing decays
    assert times.prompt_squares == pytest.approx(256 * keep * keep + 768 * keep + 576)
    # the last chunk samples the first token; two decode steps of one sequence attend 41 and 42 tokens
    assert times.decode_steps == pytest.approx(keep + 1) and times.decode_seqs == pytest.approx(keep + 1)
    assert times.decode_context_tokens == pytest.approx(41 * keep + 42)
    assert times.decode_seconds > 0 and times.prompt_seconds > 0
    assert times.prompt_decode_seqs == 0


def test_a_step_with_prompt_tokens_counts_its_riding_decodes_there():
    timer = StepTimer()
    timer.record((2.0, 300.0, 50.0, 2500.0), 0.5)  # 2 decodes beside a 50-token chunk
    timer.record((3.0, 400.0, 0.0, 0.0), 0.1)
    times = timer.snapshot()
    assert (times.prompt_steps, times.prompt_decode_seqs, times.prompt_decode_context_tokens) == (1, 2, 300)
    assert (times.decode_steps, times.decode_seqs, times.decode_seconds) == (1, 3, 0.1)
    timer.record((0.0, 0.0, 0.0, 0.0), 9.0)  # an empty step is no evidence
    assert timer.snapshot() == times


def test_engine_stats_carry_step_times_over_the_wire():
    timer = StepTimer()
    timer.record((4.0, 1000.0, 0.0, 0.0), 0.25)
    stats = EngineStats(engine_id="e", role="dual", num_waiting=0, num_running=0, kv_blocks_used=0,
                        kv_blocks_total=8, queued_prefill_tokens=0, step_times=timer.snapshot())
    received, _ = decode(encode(stats))
    assert received.step_times == stats.step_times and received.step_times.decode_context_tokens == 1000
    assert decode(encode(EngineStats(engine_id="e", role="dual", num_waiting=0, num_running=0, kv_blocks_used=0,
                                     kv_blocks_total=8, queued_prefill_tokens=0)))[0].step_times.decode_steps == 0
