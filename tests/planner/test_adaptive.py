"""The adaptive layout in the simulator: N dual-role engines whose router picks each request's prefill and decode
engine. Against the static xPyD splits on a synthetic step model where prompts are costly to run beside decodes
(a 1,000-token prompt adds 1.5 s to a step, a 128-token one 25 ms) and a KV transfer costs 0.3 s: steady
prefill-heavy (3P1D is best), steady decode-heavy (0P4D is best), and the two alternating, where no static split
fits both phases."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.serve_phases import parse_phases
from pdserve.cli import main
from pdserve.planner.model.adaptive import AdaptiveTargets
from pdserve.planner.model.simulator import ClusterSpec, StepModel, simulate
from pdserve.planner.model.workload import PhasedWorkload, Workload, random_workload, workload_from_args
from pdserve.planner.profile.fit import EngineSettings
from pdserve.planner.search.goodput import find_goodput, grid_index
from pdserve.planner.search.recommend import PlanSettings, splits_of

COSTLY_PROMPTS = StepModel(prefill_intercept=0.01, prefill_per_token=0.0, prefill_per_attention=1.5e-6,
                           decode_intercept=0.02, decode_per_seq=1e-3, decode_per_context=0.0, transfer_latency=0.3,
                           transfer_per_byte=1e-10)
SLOS = {"ttft": 3000.0, "tpot": 40.0}
CLUSTER = ClusterSpec(0, 1, EngineSettings(num_kv_blocks=4096), 46080)
NUM_ENGINES = 4
ALTERNATING = "1000:48:1:60,128:256:4:30"  # prefill-heavy, then decode-heavy at 4x the rate; two cycles


def goodputs(workload: Workload) -> tuple[dict[str, float], float]:
    """({static split: goodput}, the adaptive layout's goodput), each searched on the plan's grid."""
    settings = PlanSettings(COSTLY_PROMPTS, workload, SLOS, CLUSTER)
    start = grid_index(1.0)
    static = {f"{x}P{y}D": find_goodput(settings, x, y, start, first_step=8).rate for x, y in splits_of(NUM_ENGINES)}
    return static, find_goodput(settings, 0, NUM_ENGINES, start, first_step=8, adaptive=True).rate


def test_on_a_steady_prefill_heavy_load_adaptive_is_within_a_tenth_of_the_best_split():
    static, adaptive = goodputs(random_workload(400, 1000, 48, seed=0))
    assert max(static, key=static.get) == "3P1D"  # by construction: prompts must not run beside decodes
    assert adaptive >= 0.9 * max(static.values())


def test_on_a_steady_decode_heavy_load_adaptive_is_within_a_tenth_of_the_best_split():
    static, adaptive = goodputs(random_workload(400, 128, 256, seed=0))
    assert max(static, key=static.get) == "0P4D"  # short prompts: every engine decodes, no transfer
    assert adaptive >= 0.9 * max(static.values())


def test_on_alternating_phases_adaptive_beats_every_static_split():
    static, adaptive = goodputs(PhasedWorkload.of(parse_phases(ALTERNATING), 2, seed=0))
    assert adaptive > 1.1 * max(static.values()), (static, adaptive)


def test_where_prompts_cost_nothing_beside_decodes_every_request_colocates():
    """An H200-like fit: a prompt's tokens add nothing to a decode step, so a transfer only costs; no pair is taken."""
    free_prompts = StepModel(0.037, 0.0, 0.0, 0.0022, 2.3e-5, 3.7e-7, 0.07, 1.3e-9)
    workload = random_workload(300, 1000, 48, seed=1)
    spec = ClusterSpec(0, 4, adaptive=AdaptiveTargets.from_slos_ms({"ttft": 2000.0, "tpot": 50.0}))
    requests = simulate(spec, free_prompts, workload.arrivals(20.0, seed=1), workload.prompt_lens, workload.output_lens)
    assert all(r.finish is not None and not r.remote and r.prefill_engine is None for r in requests)
    assert len({r.decode_engine.index for r in requests}) == 4  # spread over every engine


def test_a_long_prompt_goes_to_a_prefill_engine_and_its_kv_to_a_decode_engine_once_prompts_crowd_decodes():
    """Steady prefill-heavy load: the engines that lean to prefill compute the prompts, the others decode them; every
    request pays one transfer, and the first token comes from the prefill engine."""
    workload = random_workload(200, 1000, 48, seed=2)
    spec = ClusterSpec(0, NUM_ENGINES, CLUSTER.settings, adaptive=AdaptiveTargets.from_slos_ms(SLOS))
    requests = simulate(spec, COSTLY_PROMPTS, workload.arrivals(1.2, seed=2), workload.prompt_lens,
                        workload.output_lens)
    later = requests[50:]  # once the policy has seen the load
    remote = [r for r in later if r.remote]
    assert len(remote) >= 0.9 * len(later)
    prefill_engines = {r.prefill_engine.index for r in remote}
    decode_engines = {r.decode_engine.index for r in remote}
    assert len(prefill_engines & decode_engines) <= 1  # roles stay apart (one engine may change its lean)
    assert all(r.first_token == r.prompt_done for r in remote)


def test_the_phased_mix_scales_its_phases_rates_together_and_keeps_their_lengths():
    phases = parse_phases("1000:48:1:20,128:256:4:10")
    workload = PhasedWorkload.of(phases, 2, seed=3)
    assert workload.mean_rate == pytest.approx((1 * 20 + 4 * 10) / 30)
    arrivals, prompts, outputs = workload.at_rate(2 * workload.mean_rate)
    assert len(arrivals) == pytest.approx(2 * len(workload), rel=0.25)  # twice the rate, the same 60 s
    assert max(arrivals) < 60.0
    for arrival, prompt, output in zip(arrivals, prompts, outputs):
        in_first_phase = arrival % 30.0 < 20.0
        assert (prompt, output) == ((1000, 48) if in_first_phase else (128, 256))
    assert workload.at_rate(2 * workload.mean_rate) == (arrivals, prompts, outputs)  # seeded


def plan_args(**overrides) -> argparse.Namespace:
    values = {"dataset": "phased", "phases": None, "phase_cycles": 1, "num_prompts": 100, "seed": 0}
    return argparse.Namespace(**{**values, **overrides})


@pytest.mark.parametrize("args, fix", [
    (plan_args(), "needs --phases"),
    (plan_args(dataset="random", phases="1000:48:1:10"), "--dataset phased"),
    (plan_args(phases="1000:48:1"), "IN:OUT:RATE:SECONDS"),
    (plan_args(phases="1000:48:0:10"), "request_rate 0 must be above 0"),
    (plan_args(phases="1000:48:1:10", phase_cycles=0), "--phase-cycles 0 must be at least 1"),
])
def test_a_bad_phase_input_names_the_fix(args, fix):
    with pytest.raises(ValueError, match=fix):
        workload_from_args(args)


def test_plan_prints_the_adaptive_line_beside_the_best_split(profile_path, tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--profile", profile_path, "--engines", "3", "--slo", "ttft:1000", "tpot:100", "--dataset",
                 "phased", "--phases", "512:32:4:10,128:128:8:10", "--phase-cycles", "2", "--request-rate", "4",
                 "--adaptive", "--no-plots", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "plan.json").read_text())
    adaptive = result["adaptive"]
    assert adaptive["config"] == "adaptive" and adaptive["num_engines"] == 3
    assert "adaptive (3 dual-role engines" in printed
    best = result["recommended"]
    assert f"the best static split {best['config']}" in printed and "(predicted)" in printed
    assert [row["config"] for row in result["splits"]] == ["0P3D", "1P2D", "2P1D"]  # adaptive is never recommended
    assert result["dataset"]["phases"] == "512:32:4:10,128:128:8:10"


def test_the_adaptive_line_says_when_the_best_split_has_no_bound():
    from pdserve.planner.cli import adaptive_line

    adaptive = {"goodput": 3600.0, "slo_attainment": 0.9}
    unbounded = adaptive_line(adaptive, {"config": "0P64D", "goodput": float("inf")}, 64)
    assert "met the SLOs at every rate tried" in unbounded and "raise --num-prompts" in unbounded
    assert "0.90x the best static split 2P2D (4e+03 req/s)" in adaptive_line(adaptive, {"config": "2P2D",
                                                                                      "goodput": 4000.0}, 4)
