"""`pdserve profile --quick` on the tiny model: real engine steps and KV messages, a profile plan accepts."""

from __future__ import annotations

import json
import os

from pdserve.bench.plan_fit import load_profile, model_identity
from pdserve.cli import main


def test_profile_measures_a_real_engine_and_plan_reads_it(model_factory, tmp_path, capsys):
    model = model_factory()
    out = tmp_path / "profile.json"
    cores = os.sched_getaffinity(0)
    assert main(["profile", "--model", model, "--quick", "--repeats", "1", "--out", str(out)]) == 0
    assert os.sched_getaffinity(0) == cores  # pinned to one core only while measuring
    profile = load_profile(out)
    assert profile.model == model_identity(model)
    assert profile.machine["pinned_core"] is not None and profile.machine["torch"]
    assert {p.batch for p in profile.decode_points} >= {1, 4}
    assert any(p.batch > 1 for p in profile.prefill_points)
    assert all(p.seconds > 0 and p.cpu_seconds > 0 for p in profile.prefill_points + profile.decode_points)
    assert [p.bytes for p in profile.transfer_points] == [1 << 20, 2 << 20]
    reference = profile.machine["reference"]  # a served engine's prompt, to judge the machine's drift by
    assert reference["prompt_len"] > 1 and reference["served_prefill_wall_s"] > 0
    assert reference["profile_prefill_s"] > 0
    for fit in (profile.prefill_fit, profile.decode_fit, profile.transfer_fit):
        assert all(value >= 0 for value in fit.coefficients.values())
    assert "R^2" in capsys.readouterr().out
    plan_dir = tmp_path / "plan"
    assert main(["plan", "--profile", str(out), "--model", model, "--engines", "2", "--slo", "ttft:60000",
                 "--num-prompts", "20", "--input-len", "32", "--output-len", "8", "--request-rate", "1",
                 "--output-dir", str(plan_dir), "--no-plots"]) == 0
    assert len(json.loads((plan_dir / "plan.json").read_text())["splits"]) == 2


def test_served_decode_points_time_a_real_engine_process(model_factory):
    from pdserve.bench.plan_served import SERVED_TOKENS, served_decode_points, served_engine

    with served_engine(model_factory(), min(os.sched_getaffinity(0)), max_num_batched_tokens=64) as session:
        points = served_decode_points(session, [(1, 8), (3, 8)])
    assert [(p.batch, p.context) for p in points] == [(1, 8 + SERVED_TOKENS // 2), (3, 3 * (8 + SERVED_TOKENS // 2))]
    assert all(p.seconds > 0 and p.cpu_seconds >= 0 for p in points)
