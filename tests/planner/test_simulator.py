"""The simulator against closed forms: M/D/1 waiting at low load, a decode-only batch, the KV pool, seeds."""

from __future__ import annotations

import pytest

from pdserve.planner.profile.fit import EngineSettings
from pdserve.planner.model.host_effects import HostEffects
from pdserve.planner.model.simulator import ClusterSpec, StepModel, simulate, simulate_tiers
from pdserve.planner.model.workload import Workload, random_workload


def model(**overrides) -> StepModel:
    names = ("prefill_intercept", "prefill_per_token", "prefill_per_attention", "decode_intercept", "decode_per_seq",
             "decode_per_context", "transfer_latency", "transfer_per_byte")
    return StepModel(**{**dict.fromkeys(names, 0.0), **overrides})


def test_one_engine_with_constant_service_has_the_md1_waiting_time():
    service, rate, prompt = 0.1, 3.0, 256  # load 0.3
    settings = EngineSettings(max_num_batched_tokens=prompt)  # one prompt a step: a single server
    workload = random_workload(20000, prompt, 1, seed=1)
    requests = simulate(ClusterSpec(0, 1, settings), model(prefill_intercept=service), workload.arrivals(rate, seed=1),
                        workload.prompt_lens, workload.output_lens)
    load = rate * service
    md1_wait = load * service / (2 * (1 - load))
    mean_ttft = sum(r.ttft for r in requests) / len(requests)
    assert mean_ttft - service == pytest.approx(md1_wait, rel=0.08)


def test_a_decode_only_batch_takes_the_step_time_per_token():
    step, batch, output = 0.05, 8, 40
    requests = simulate(ClusterSpec(0, 1), model(decode_intercept=step), [0.0] * batch, [16] * batch,
                        [output] * batch)
    for request in requests:
        assert request.first_token == 0.0  # the prefill step costs nothing here
        assert request.finish == pytest.approx(step * (output - 1))
        assert request.tpot == pytest.approx(step)


def test_decode_steps_grow_with_the_context_in_closed_form():
    d0, per_seq, per_context, batch, prompt, output = 0.02, 0.001, 1e-5, 4, 100, 30
    requests = simulate(ClusterSpec(0, 1), model(decode_intercept=d0, decode_per_seq=per_seq,
                                                 decode_per_context=per_context),
                        [0.0] * batch, [prompt] * batch, [output] * batch)
    expected = sum(d0 + per_seq * batch + per_context * batch * (prompt + 1 + j) for j in range(output - 1))
    assert requests[0].finish == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("pads", [True, False])
def test_a_padding_backend_pays_for_the_longest_context_until_it_leaves(pads):
    """Prompts of 300 and 100 tokens decode together for 9 steps; then the long one is done. A padding backend's
    steps read 2 x the longest context while both decode, and the short one's own once the long one left."""
    d0, per_seq, per_context = 0.02, 0.001, 1e-5
    step_model = model(decode_intercept=d0, decode_per_seq=per_seq, decode_per_context=per_context)
    long_request, short_request = simulate(ClusterSpec(0, 1), step_model, [0.0, 0.0], [300, 100], [10, 30],
                                           effects=HostEffects(decode_pads_to_longest=pads))
    together = [2 * (301 + j) if pads else (301 + j) + (101 + j) for j in range(9)]
    alone = [101 + j for j in range(9, 29)]
    assert long_request.finish == pytest.approx(sum(d0 + 2 * per_seq + per_context * c for c in together), rel=1e-9)
    assert short_request.finish == pytest.approx(long_request.finish + sum(d0 + per_seq + per_context * c
                                                                            for c in alone), rel=1e-9)


@pytest.mark.parametrize("long_prompt, padded", [(300, True), (700, False)])
def test_a_grouping_backend_pays_for_the_padding_of_each_length_group(long_prompt, padded):
    """The CPU backend (kernels.length_groups.group_by_length) pads a group to its longest when that costs at most
    256 tokens (or 10% of the group's): 301 and 101 tokens share one group and read 2 x 301; 701 and 101 run as two
    groups and read their sum. The difference between the two contexts stays as each grows by one a step."""
    d0, per_seq, per_context = 0.02, 0.001, 1e-5
    step_model = model(decode_intercept=d0, decode_per_seq=per_seq, decode_per_context=per_context)
    long_request, short_request = simulate(ClusterSpec(0, 1), step_model, [0.0, 0.0], [long_prompt, 100], [10, 30],
                                           effects=HostEffects(decode_groups_by_length=True))
    together = [2 * (long_prompt + 1 + j) if padded else (long_prompt + 1 + j) + (101 + j) for j in range(9)]
    assert long_request.finish == pytest.approx(sum(d0 + 2 * per_seq + per_context * c for c in together), rel=1e-9)
    assert short_request.finish == pytest.approx(long_request.finish + sum(d0 + per_seq + per_context * (101 + j)
                                                                            for j in range(9, 29)), rel=1e-9)


def test_an_arrival_in_a_decode_run_joins_at_the_next_step_boundary():
    step = 0.05
    requests = simulate(ClusterSpec(0, 1), model(decode_intercept=step), [0.0, 0.123], [16, 16], [20, 5])
    first, late = requests
    # the step under way ends at 0.15; the next one decodes the first request and prefills the late one
    assert late.first_token == pytest.approx(0.2)
    assert late.finish == pytest.approx(0.2 + 4 * step)
    assert first.finish == pytest.approx(19 * step)  # one step per token all along


def test_seeds_make_runs_repeat_and_differ():
    workload = random_workload(300, 200, 50, range_ratio=0.5, seed=3)
    cost = model(prefill_intercept=0.01, prefill_per_token=1e-4, decode_intercept=0.02, decode_per_seq=1e-3,
                 transfer_latency=0.005, transfer_per_byte=1e-9)

    def ttfts(seed: int) -> list[float]:
        return [r.ttft for r in simulate(ClusterSpec(1, 2), cost, workload.arrivals(5.0, seed=seed),
                                         workload.prompt_lens, workload.output_lens)]

    assert ttfts(0) == ttfts(0)
    assert ttfts(0) != ttfts(1)


def test_a_small_kv_pool_preempts_and_every_request_still_finishes():
    settings = EngineSettings(num_kv_blocks=40, block_size=16)  # 640 tokens
    requests = simulate(ClusterSpec(0, 1, settings), model(decode_intercept=0.01), [0.0] * 8, [64] * 8, [64] * 8)
    assert all(r.finish is not None for r in requests)
    assert sum(r.num_preemptions for r in requests) > 0


def test_the_first_token_leaves_the_prefill_engine_and_the_transfer_delays_the_second():
    cost = model(prefill_intercept=0.2, decode_intercept=0.05, transfer_latency=0.01, transfer_per_byte=1e-8)
    spec = ClusterSpec(1, 1, kv_bytes_per_token=1000)
    request, = simulate(spec, cost, [0.0], [500], [3])
    # the prefill engine publishes the first token when the prompt is computed, before the KV moves;
    # the decode engine's two steps follow the transfer
    assert request.first_token == pytest.approx(0.2)
    assert request.finish == pytest.approx(0.2 + 0.01 + 500 * 1000 * 1e-8 + 2 * 0.05)
    streamed, = simulate(ClusterSpec(1, 1, kv_bytes_per_token=1000, kv_streaming=True), cost, [0.0], [500], [3])
    assert streamed.first_token == pytest.approx(0.2)
    assert streamed.finish == pytest.approx(0.2 + 0.01 + 2 * 0.05)


def test_a_remote_request_alone_carries_its_kv_transfer_in_the_first_itl():
    # 1P1D at batch 1, constant steps: the prompt's step p on the prefill engine ends TTFT; the KV then takes
    # x = latency + bytes * s/B on the link and r = bytes * receiver CPU on the decode engine's core, before the
    # decode engine's first step s makes the second token; every later token takes one step s
    prefill, step, latency, per_byte, receiver, prompt, output, kv_bytes = 0.3, 0.05, 0.01, 1e-8, 4e-9, 500, 6, 1000
    cost = model(prefill_intercept=prefill, decode_intercept=step, transfer_latency=latency, transfer_per_byte=per_byte,
                 receiver_cpu_per_byte=receiver, sender_cpu_per_byte=7e-9)  # the sender's CPU delays its next step only
    request, = simulate(ClusterSpec(1, 1, kv_bytes_per_token=kv_bytes), cost, [0.0], [prompt], [output])
    transfer = latency + prompt * kv_bytes * per_byte
    admission = prompt * kv_bytes * receiver
    assert request.ttft == pytest.approx(prefill)
    assert request.first_itl == pytest.approx(transfer + admission + step)
    assert request.tpot == pytest.approx((transfer + admission + step + (output - 2) * step) / (output - 1))
    colocated, = simulate(ClusterSpec(0, 1, kv_bytes_per_token=kv_bytes), cost, [0.0], [prompt], [output])
    assert colocated.ttft == pytest.approx(prefill)
    assert colocated.first_itl == pytest.approx(step)  # no transfer: the next step


def test_kv_landing_mid_step_waits_for_the_step_boundary_then_pays_its_receive():
    # B's KV lands while the decode engine is in one of A's steps: B joins at that step's end, after the
    # receive r, and its second token comes one step s later
    step, receiver, kv_bytes = 0.05, 4e-9, 1000
    cost = model(prefill_intercept=0.3, decode_intercept=step, transfer_latency=0.012, receiver_cpu_per_byte=receiver)
    first, second = simulate(ClusterSpec(1, 1, kv_bytes_per_token=kv_bytes), cost, [0.0, 0.0], [500, 500], [40, 5])
    # one prefill step computes both prompts (0.3); A's KV lands at 0.312, B's too: both pay 2 * r at 0.312
    both = 0.3 + 0.012 + 2 * 500 * kv_bytes * receiver
    assert first.first_itl == pytest.approx(both + step - 0.3)
    assert second.first_itl == pytest.approx(both + step - 0.3)
    late, = [r for r in simulate(ClusterSpec(1, 1, kv_bytes_per_token=kv_bytes), cost, [0.0, 0.33], [500, 500],
                                 [40, 5]) if r.index == 1]
    a_decodes_from = 0.3 + 0.012 + 500 * kv_bytes * receiver  # A alone: its KV in, then steps of s
    lands = 0.33 + 0.3 + 0.012  # B's prompt is computed in the prefill engine's next step, then its transfer
    boundary = a_decodes_from + step * (int((lands - a_decodes_from) / step) + 1)
    assert late.second_token == pytest.approx(boundary + 500 * kv_bytes * receiver + step)


@pytest.mark.parametrize("streaming", [False, True])
def test_one_engine_per_tier_matches_the_whole_cluster_for_1p1d(streaming):
    # the tiers take arrivals and transfer ends from queues known ahead; the whole cluster, from events
    workload = random_workload(100, 300, 40, range_ratio=0.5, seed=2)
    cost = model(prefill_intercept=0.01, prefill_per_token=1e-4, decode_intercept=0.02, decode_per_seq=1e-3,
                 decode_per_context=1e-6, transfer_latency=0.005, transfer_per_byte=1e-9, sender_cpu_per_byte=1e-10,
                 receiver_cpu_per_byte=1e-10)
    arrivals = workload.arrivals(4.0, seed=2)
    spec = ClusterSpec(1, 1, kv_streaming=streaming)
    exact = simulate(spec, cost, arrivals, workload.prompt_lens, workload.output_lens)
    tiers = simulate_tiers(spec, cost, arrivals, workload.prompt_lens, workload.output_lens)
    assert [r.first_token for r in exact] == pytest.approx([r.first_token for r in tiers])
    assert [r.second_token for r in exact] == pytest.approx([r.second_token for r in tiers])
    assert [r.finish for r in exact] == pytest.approx([r.finish for r in tiers])


@pytest.mark.parametrize("num_prefill, num_decode, rate, num_kv_blocks", [(3, 2, 12.0, 4096), (1, 1, 4.0, 90)])
def test_admitting_remote_arrivals_after_the_fact_changes_no_time(monkeypatch, num_prefill, num_decode, rate,
                                                                  num_kv_blocks):  # 90 blocks: a pool that preempts
    from pdserve.planner.model import simulator as plan_simulator

    def cut_at_every_input(engine, now, num_steps, first, growth):  # the rule without admission after the fact
        next_input = engine._next_input()
        if next_input < now + plan_simulator._run_seconds(num_steps, first, growth):
            num_steps = min(num_steps, plan_simulator._steps_done_by(next_input - now, first, growth) + 1)
        return num_steps

    workload = random_workload(300, 300, 40, range_ratio=0.5, seed=6)
    cost = model(prefill_intercept=0.01, prefill_per_token=1e-4, decode_intercept=0.02, decode_per_seq=1e-3,
                 decode_per_context=1e-6, transfer_latency=0.005, transfer_per_byte=1e-9, receiver_cpu_per_byte=1e-10)
    spec = ClusterSpec(num_prefill, num_decode, EngineSettings(num_kv_blocks=num_kv_blocks))
    args = (spec, cost, workload.arrivals(rate, seed=6), workload.prompt_lens, workload.output_lens)
    admitted = []
    admit = plan_simulator.SimEngine._admit_after_the_fact
    monkeypatch.setattr(plan_simulator.SimEngine, "_admit_after_the_fact",
                        lambda engine, request, when: admitted.append(request) or admit(engine, request, when))
    fast = simulate_tiers(*args)
    monkeypatch.setattr(plan_simulator.SimEngine, "_steps_before_input", cut_at_every_input)
    plain = simulate_tiers(*args)
    assert admitted  # the runs did go past arrivals
    assert [r.first_token for r in fast] == pytest.approx([r.first_token for r in plain], rel=1e-12)
    assert [r.finish for r in fast] == pytest.approx([r.finish for r in plain], rel=1e-12)
    assert [r.num_preemptions for r in fast] == [r.num_preemptions for r in plain]
    assert (sum(r.num_preemptions for r in plain) > 0) == (num_kv_blocks < 100)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no requests"):
        Workload([], [])
    with pytest.raises(ValueError, match="at least one decode engine"):
        ClusterSpec(2, 0)
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        simulate(ClusterSpec(0, 1, EngineSettings(num_kv_blocks=2)), model(), [0.0], [100], [10])


def test_a_goodput_probe_stops_once_it_cannot_reach_the_target():
    from pdserve.planner.model.simulator import BudgetExceeded

    workload = random_workload(400, 200, 20, seed=4)
    cost = model(prefill_intercept=0.05, prefill_per_token=1e-3, decode_intercept=0.02)  # ~5 prompts/s at most
    slos = ({"ttft": 500.0}, 0.9)
    light = simulate(ClusterSpec(0, 1), cost, workload.arrivals(1.0, seed=4), workload.prompt_lens,
                     workload.output_lens, stop_below=slos)
    assert sum(r.ttft <= 0.5 for r in light) >= 0.9 * len(light)
    with pytest.raises(BudgetExceeded):
        simulate(ClusterSpec(0, 1), cost, workload.arrivals(50.0, seed=4), workload.prompt_lens,
                 workload.output_lens, stop_below=slos)


@pytest.mark.parametrize("run, spec", [(simulate, ClusterSpec(1, 2)), (simulate_tiers, ClusterSpec(3, 7))])
def test_the_early_stop_gives_the_full_simulations_verdict(run, spec):
    from pdserve.planner.model.metrics import meets_target, predicted_metrics
    from pdserve.planner.model.simulator import BudgetExceeded

    workload = random_workload(300, 300, 30, range_ratio=0.5, seed=5)
    cost = model(prefill_intercept=0.02, prefill_per_token=2e-4, prefill_per_attention=1e-8, decode_intercept=0.03,
                 decode_per_seq=2e-3, decode_per_context=1e-6, transfer_latency=0.005, transfer_per_byte=1e-9)
    slos = {"ttft": 400.0, "tpot": 60.0}
    verdicts = []
    for rate_per_engine in (0.3, 1.0, 2.0, 3.0, 4.0, 6.0, 10.0):
        rate = rate_per_engine * (spec.num_prefill + spec.num_decode)
        args = (spec, cost, workload.arrivals(rate, seed=5), workload.prompt_lens, workload.output_lens)
        full = meets_target(predicted_metrics(run(*args), slos))
        try:
            early = meets_target(predicted_metrics(run(*args, stop_below=(slos, 0.9)), slos))
        except BudgetExceeded:
            early = False
        assert early == full, f"rate {rate}"
        verdicts.append(full)
    assert True in verdicts and False in verdicts  # both verdicts occur over these rates
