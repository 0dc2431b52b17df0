"""The host's CPU per streamed token (router and clients on a CPU host whose cores are all the engines'): charged to
a busy engine's step for the tokens it streams while no engine is idle, in closed form; free while one is; left out
of the one-engine-per-tier estimate; taken from a sweep's own server_cpu_s and client_cpu_s by `plan --validate`."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.planner.profile.fit import load_profile, model_identity
from pdserve.planner.model.host_cpu import NO_HOST_CPU, given_host_cpu, measured_host_cpu, validate_host_cpu
from pdserve.planner.model.host_effects import HostEffects
from pdserve.planner.model.simulator import ClusterSpec, simulate, simulate_tiers
from pdserve.cli import main
from tests.planner.helpers import synthetic_profile, write_sweep
from tests.planner.test_simulator import model


def test_one_engine_pays_for_every_token_it_streams():
    """One engine, one core: the router has no other. The prefill step streams the batch's first tokens, and every
    decode step streams one token per request: each takes batch x c more."""
    step, c, batch, output = 0.05, 0.002, 8, 40
    requests = simulate(ClusterSpec(0, 1), model(decode_intercept=step), [0.0] * batch, [16] * batch,
                        [output] * batch, effects=HostEffects(cpu_per_token=c))
    for request in requests:
        assert request.first_token == pytest.approx(batch * c)
        assert request.finish == pytest.approx(batch * c + (output - 1) * (step + batch * c))


def test_the_background_takes_its_share_of_every_busy_core():
    """0.2 cores of background on two busy engines: each core gives 10% of its time to it, so every step takes
    s / 0.9 (the growing context term too); on one engine, 20%."""
    d0, per_context, batch, output = 0.05, 1e-5, 4, 30
    cost, background = model(decode_intercept=d0, decode_per_context=per_context), HostEffects(background_cores=0.2)
    plain = sum(d0 + per_context * batch * (16 + 1 + j) for j in range(output - 1))
    two = simulate(ClusterSpec(0, 2, decode_policy="round_robin"), cost, [0.0] * 2 * batch, [16] * 2 * batch,
                   [output] * 2 * batch, effects=background)
    assert all(r.finish == pytest.approx(plain / 0.9) for r in two)
    one = simulate(ClusterSpec(0, 1), cost, [0.0] * batch, [16] * batch, [output] * batch, effects=background)
    assert all(r.finish == pytest.approx(plain / 0.8) for r in one)
    with pytest.raises(ValueError, match="less than one core per engine"):
        simulate(ClusterSpec(0, 1), cost, [0.0], [16], [4], effects=HostEffects(background_cores=1.0))


def test_a_busy_engine_pays_only_while_the_other_is_busy_too():
    """0P2D, round robin, constant steps s and prompts of P; c per token. A decodes on engine 0 from 1.0; its steps
    are free while engine 1 idles. B arrives at 1.55: engine 1's prompt step [1.55, 2.56] pays c for B's first token;
    A's step under way (from 1.5) keeps its time, and from 1.6 A's steps take s + c. B decodes two steps of s + c
    (to 2.67, 2.78) and leaves; engine 1 idles again from 2.78, and A's step under way then (1.6 + 11 x 0.11 = 2.81)
    is the last that pays."""
    s, prefill, c = 0.1, 1.0, 0.01
    cost = model(prefill_intercept=prefill, decode_intercept=s)
    a, b = simulate(ClusterSpec(0, 2, decode_policy="round_robin"), cost, [0.0, 1.55], [16, 16], [40, 3],
                    effects=HostEffects(cpu_per_token=c))
    assert a.decode_engine is not b.decode_engine
    assert a.first_token == pytest.approx(prefill)  # engine 1 idle: free
    assert b.first_token == pytest.approx(1.55 + prefill + c)
    assert b.finish == pytest.approx(1.55 + prefill + c + 2 * (s + c))
    assert a.finish == pytest.approx(prefill + 6 * s + 11 * (s + c) + 22 * s)
    plain, _ = simulate(ClusterSpec(0, 2, decode_policy="round_robin"), cost, [0.0, 1.55], [16, 16], [40, 3])
    assert plain.finish == pytest.approx(prefill + 39 * s)


def test_an_idle_core_serves_the_host_for_free():
    """1P1D with requests far apart: the prefill engine idles while the decode engine decodes and the other way
    round, so the host's CPU always has a core: nothing changes."""
    cost = model(prefill_intercept=0.3, prefill_per_token=1e-4, decode_intercept=0.05, decode_per_seq=1e-3,
                 transfer_latency=0.01, transfer_per_byte=1e-9)
    args = ([0.0, 10.0, 20.0], [200, 100, 300], [20, 30, 10])
    plain = simulate(ClusterSpec(1, 1), cost, *args)
    charged = simulate(ClusterSpec(1, 1), cost, *args, effects=HostEffects(cpu_per_token=0.005))
    assert [(r.first_token, r.second_token, r.finish) for r in charged] == \
        [(r.first_token, r.second_token, r.finish) for r in plain]


def test_one_engine_per_tier_leaves_the_host_out():
    """A large cluster's hosts and cores are not known: the tier estimate charges nothing."""
    cost = model(prefill_intercept=0.3, decode_intercept=0.05)
    args = ([0.0, 0.1, 0.2, 0.4], [100] * 4, [30] * 4)
    tiers = simulate_tiers(ClusterSpec(1, 1), cost, *args, effects=HostEffects(cpu_per_token=0.01))
    plain = simulate_tiers(ClusterSpec(1, 1), cost, *args)
    assert [r.finish for r in tiers] == [r.finish for r in plain]
    assert simulate(ClusterSpec(1, 1), cost, *args, effects=HostEffects(cpu_per_token=0.01))[0].finish > \
        plain[0].finish


def run_record(server: float | None, client: float | None, tokens: int, duration: float = 10.0) -> dict:
    run = {"total_output_tokens": tokens, "client_cpu_s": client, "duration": duration}
    if server is not None:
        run["server_metrics"] = {"server_cpu_s": server}
    return run


def host_args(per_token: float | None = None, background: float | None = None) -> argparse.Namespace:
    return argparse.Namespace(host_cpu_per_token=per_token, host_background_cpu=background)


def test_the_sweeps_figures_are_fitted_over_its_runs_router_and_client_cpu():
    """CPU = 1% of a core x duration + 250 us x tokens, split between router and client: the fit finds both."""
    shapes = [(1152, 240.0), (1152, 88.0), (6144, 50.0), (96, 12.5)]
    runs = [run_record(0.7 * (0.01 * d + 250e-6 * t), 0.3 * (0.01 * d + 250e-6 * t), t, d) for t, d in shapes]
    host = measured_host_cpu(runs)
    assert host.seconds_per_token == pytest.approx(250e-6)
    assert host.background_cores == pytest.approx(0.01)
    assert (host.num_runs, host.rms_error_s) == (4, pytest.approx(0.0, abs=1e-9))
    assert "250 us per streamed token + 1.00% of a core" in host.describe()
    assert measured_host_cpu(runs[:2]) is None  # too few runs to fit two figures
    assert measured_host_cpu([*runs[:2], run_record(None, 1.0, 100)]) is None  # a run from before server_cpu_s
    assert measured_host_cpu([*runs[:2], run_record(2.0, None, 100)]) is None


def test_a_negative_figure_is_dropped_and_the_other_fitted_alone():
    """Runs whose CPU falls with their duration: no background, the tokens carry it all (least squares alone)."""
    runs = [run_record(0.5, 0.0, 1000, 100.0), run_record(0.6, 0.0, 1000, 10.0), run_record(1.0, 0.0, 2000, 50.0)]
    host = measured_host_cpu(runs)
    assert host.background_cores == 0.0
    assert host.seconds_per_token == pytest.approx((0.5 * 1000 + 0.6 * 1000 + 1.0 * 2000) / (1000**2 * 2 + 2000**2))


def test_validate_takes_the_flags_then_the_sweep_and_never_charges_a_gpu_host(model_factory):
    """Each layout gets its own fit: 400 us per token on 0P2D, 100 us on 1P1D; 0P1D did not record the router's CPU."""
    profile = synthetic_profile(model_identity(model_factory()))
    shapes = ((10_000, 100.0), (5_000, 80.0), (500, 20.0))
    runs = [{**run_record(3.0 * t / 10_000, t / 10_000, t, d), "config": "0P2D"} for t, d in shapes]
    runs += [{**run_record(0.75 * t / 10_000, 0.25 * t / 10_000, t, d), "config": "1P1D"} for t, d in shapes]
    runs += [{**run_record(None, 1.0, 100), "config": "0P1D"}] * 3
    configs = ["0P1D", "0P2D", "1P1D", "2P2D"]

    def figures(args, of_profile=profile):
        return validate_host_cpu(args, of_profile, configs, runs, "sweep")

    assert {config: host.seconds_per_token for config, host in figures(host_args()).items()} == \
        {"0P1D": 0.0, "0P2D": pytest.approx(4e-4), "1P1D": pytest.approx(1e-4), "2P2D": 0.0}
    assert figures(host_args())["2P2D"].source == "not charged: sweep has no server_cpu_s for the layout"
    given = figures(host_args(50.0, 0.02))
    assert set(given) == set(configs)
    assert all((h.seconds_per_token, h.background_cores) == (pytest.approx(50e-6), 0.02) for h in given.values())
    gpu = profile.model_copy(update={"machine": {**profile.machine, "device": "cuda:0"}})
    assert all(host is NO_HOST_CPU for host in figures(host_args(), gpu).values())
    assert all(host is NO_HOST_CPU for host in figures(host_args(0.0, 0.0)).values())


@pytest.mark.parametrize("per_token, background, flag", [
    (-1.0, None, "--host-cpu-per-token -1: give the microseconds"), (float("nan"), None, "--host-cpu-per-token nan"),
    (float("inf"), None, "--host-cpu-per-token inf"), (None, 1.0, "--host-background-cpu 1: give the share"),
    (None, -0.1, "--host-background-cpu -0.1"),
])
def test_a_bad_figure_is_refused(per_token, background, flag):
    with pytest.raises(ValueError, match=flag):
        given_host_cpu(host_args(per_token, background))


def test_validate_finds_a_sweep_that_paid_for_its_host_from_its_own_figures(profile_path, tmp_path, tiny_model):
    """A 'machine' that charged 2 ms per token and 5% of a core: replayed with the figures fitted to the sweep's own
    router and client CPU, the predictions are its own (MAE 0); with --host-cpu-per-token 0 the loaded 0P2D TPOTs
    come out lower than measured."""
    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path), references=2, host=(0.002, 0.05))
    out, off = tmp_path / "validation", tmp_path / "off"
    assert main(["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--output-dir", str(out),
                 "--no-plots"]) == 0
    summary = json.loads((out / "validation.json").read_text())["summary"]
    assert set(summary["host_cpu"]) == {"0P2D", "1P1D"}
    for host in summary["host_cpu"].values():
        assert (host["seconds_per_token"], host["background_cores"]) == (pytest.approx(0.002), pytest.approx(0.05))
    assert summary["attainment_mae_pp"] == pytest.approx(0.0, abs=1e-9)
    assert summary["median_tpot_ms_mean_relative_error"] == pytest.approx(0.0, abs=1e-9)
    assert main(["plan", "--profile", profile_path, "--validate", str(sweep_dir), "--output-dir", str(off),
                 "--no-plots", "--host-cpu-per-token", "0"]) == 0
    points = json.loads((off / "validation.json").read_text())["points"]
    assert all(p["predicted_median_tpot_ms"] < p["measured_median_tpot_ms"] for p in points if p["config"] == "0P2D")


def test_validate_fits_the_host_to_another_sweep_of_the_same_machine(profile_path, tmp_path, tiny_model):
    """A sweep that did not record server_cpu_s, replayed with the figures of one that did (--host-cpu-from): the
    charging machine's predictions again. The flags and --host-cpu-from together, or --host-cpu-from without
    --validate, are refused."""
    profile = load_profile(profile_path)
    measured, unrecorded = tmp_path / "measured", tmp_path / "unrecorded"
    write_sweep(measured, tiny_model, profile, references=2, host=(0.002, 0.05))
    write_sweep(unrecorded, tiny_model, profile, host=(0.002, 0.05))
    for path in (unrecorded / "runs").glob("*.json"):
        run = json.loads(path.read_text())
        del run["server_metrics"]
        path.write_text(json.dumps(run))
    out = tmp_path / "validation"
    assert main(["plan", "--profile", profile_path, "--validate", str(unrecorded), "--host-cpu-from", str(measured),
                 "--output-dir", str(out), "--no-plots"]) == 0
    summary = json.loads((out / "validation.json").read_text())["summary"]
    assert summary["median_tpot_ms_mean_relative_error"] == pytest.approx(0.0, abs=1e-9)
    assert all(host["seconds_per_token"] == pytest.approx(0.002) for host in summary["host_cpu"].values())
    assert main(["plan", "--profile", profile_path, "--validate", str(unrecorded), "--output-dir", str(out),
                 "--no-plots"]) == 0
    summary = json.loads((out / "validation.json").read_text())["summary"]
    assert all(host["seconds_per_token"] == 0.0 for host in summary["host_cpu"].values())
    assert summary["median_tpot_ms_mean_relative_error"] > 0


@pytest.mark.parametrize("extra, message", [
    (["--validate", "SWEEP", "--host-cpu-from", "SWEEP", "--host-cpu-per-token", "100"], "pass one or the other"),
    (["--engines", "2", "--slo", "ttft:1000", "--host-cpu-from", "SWEEP"], "--host-cpu-from fits the host's CPU"),
])
def test_conflicting_host_flags_are_refused(profile_path, tmp_path, tiny_model, capsys, extra, message):
    sweep_dir = tmp_path / "sweep"
    write_sweep(sweep_dir, tiny_model, load_profile(profile_path))
    extra = [str(sweep_dir) if arg == "SWEEP" else arg for arg in extra]
    assert main(["plan", "--profile", profile_path, *extra, "--output-dir", str(tmp_path / "out"), "--no-plots"]) == 2
    assert message in capsys.readouterr().err


def test_plan_charges_the_host_only_when_given(profile_path, tmp_path, capsys):
    """`pdserve plan` charges nothing by default; with the flags its whole-cluster splits are slower and say so."""
    def plan_rows(out, *extra):
        assert main(["plan", "--profile", profile_path, "--engines", "2", "--slo", "ttft:1000", "tpot:100",
                     "--request-rate", "8", "--num-prompts", "200", "--input-len", "256", "--output-len", "32",
                     "--no-plots", "--output-dir", str(out), *extra]) == 0
        result = json.loads((out / "plan.json").read_text())
        return result, {row["config"]: row for row in result["splits"]}

    plain, plain_rows = plan_rows(tmp_path / "plain")
    assert plain["host_cpu"]["seconds_per_token"] == 0.0
    assert "charged to the engines' steps" not in capsys.readouterr().out
    charged, charged_rows = plan_rows(tmp_path / "charged", "--host-cpu-per-token", "2000", "--host-background-cpu",
                                      "0.1")
    assert (charged["host_cpu"]["seconds_per_token"], charged["host_cpu"]["background_cores"]) == \
        (pytest.approx(0.002), 0.1)
    assert "2000 us per streamed token + 10.00% of a core (given): charged to the engines' steps" in \
        capsys.readouterr().out
    assert charged_rows["0P2D"]["median_tpot_ms"] > plain_rows["0P2D"]["median_tpot_ms"]
