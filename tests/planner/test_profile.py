"""`pdserve profile --quick` on the tiny model: real engine steps and KV messages, a profile plan accepts."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest

from pdserve.engine.config import cpu_has_native_bf16
from pdserve.kernels import cpu_native
from pdserve.planner.profile.corun_fit import NO_CORUN, corun_terms
from pdserve.planner.profile.fit import load_profile, model_identity
from pdserve.planner.profile.served import SERVED_TOKENS, process_cpu_s
from pdserve.cli import main
from tests.planner.helpers import synthetic_profile


def check_corun(corun: dict, shapes: dict[str, tuple[int, int]]) -> None:
    """With two cores the co-run step timed each batch alone, beside the other core's prompts and beside its
    decode steps; else 1.0."""
    if len(os.sched_getaffinity(0)) < 2:
        assert corun == {"factor": 1.0, "skipped": "one core: no second core to compute prompts on"}
        return
    for measured, kind in ((corun, "prefill"), (corun["beside_decode"], "decode")):
        assert set(measured["batches"]) == set(shapes)
        for key, row in measured["batches"].items():
            batch, prompt_len = shapes[key]
            assert (row["batch"], row["context"]) == (batch, batch * (prompt_len + SERVED_TOKENS // 2))
            assert row["alone_cpu_s"] > 0 and row["corun_cpu_s"] > 0
            assert len(row["cpu_round_ratios"]) == measured["repeats"]  # one ratio per round, each paired
            assert row["cpu_ratio"] == pytest.approx(statistics.median(row["cpu_round_ratios"]))
        assert measured["factor"] == pytest.approx(sum(r["cpu_ratio"] for r in measured["batches"].values())
                                                   / len(shapes))
        assert measured[f"{kind}_core"] != corun.get("pinned_core", -1)
    # one set of alone passes, taken between both neighbours' passes, serves both
    assert ({key: row["alone_cpu_s"] for key, row in corun["batches"].items()}
            == {key: row["alone_cpu_s"] for key, row in corun["beside_decode"]["batches"].items()})


@pytest.mark.parametrize("decode_flags, served", [([], True), (["--in-process-decode"], False)])
def test_profile_measures_a_real_engine_and_plan_reads_it(model_factory, tmp_path, capsys, decode_flags, served):
    model = model_factory()
    out = tmp_path / "profile.json"
    cores = os.sched_getaffinity(0)
    assert main(["profile", "--model", model, "--quick", "--repeats", "1", "--out", str(out), "--verbose",
                 *decode_flags]) == 0
    assert profile_decode_source(out) == ("served" if served else "in-process")  # served: the default on CPU
    assert os.sched_getaffinity(0) == cores  # pinned to one core only while measuring
    profile = load_profile(out)
    native_bf16 = cpu_has_native_bf16()
    assert profile.engine.dtype == ("bfloat16" if native_bf16 else "float32")  # auto, as resolved on this CPU
    assert profile.model == model_identity(model, profile.engine.dtype)
    assert profile.capability.device == "cpu" and profile.capability.native_bf16 == native_bf16
    assert profile.capability.name == profile.machine["cpu"]
    assert profile.machine["pinned_core"] is not None and profile.machine["torch"]
    assert {p.batch for p in profile.decode_points} >= {1, 4}
    assert not profile.engine.decode_pads_to_longest  # the CPU backend groups by length: the sum and the padding
    grouped = cpu_native.decode_kernel() is None  # the native kernel reads each context; the torch plan groups
    assert profile.engine.decode_groups_by_length == profile.decode_groups_by_length == grouped
    assert all(p.longest * p.batch == p.context for p in profile.decode_points)  # uniform batches
    assert any(p.batch > 1 for p in profile.prefill_points)
    assert all(p.seconds > 0 and p.cpu_seconds > 0 for p in profile.prefill_points + profile.decode_points)
    assert [p.bytes for p in profile.transfer_points] == [1 << 20, 2 << 20]
    for point in profile.transfer_points:  # the thread that sent (or received) is part of its process
        assert 0 < point.sender_thread_cpu_s <= point.sender_cpu_s
        assert 0 < point.receiver_thread_cpu_s <= point.receiver_cpu_s
    reference = profile.machine["reference"]  # a served engine's prompt, to judge the machine's drift by
    assert reference["prompt_len"] > 1 and reference["served_prefill_wall_s"] > 0
    assert reference["profile_prefill_s"] > 0
    check_corun(profile.machine["decode_corun"], shapes={"1x16": (1, 16), "2x16": (2, 16)})
    for factors in (profile.decode_corun, profile.decode_beside_decode):
        assert 0 < factors.weights < 10 and 0 < factors.kv_reads < 10
    for fit in (profile.prefill_fit, profile.decode_fit, profile.transfer_fit):
        assert all(value >= 0 for value in fit.coefficients.values())
    printed = capsys.readouterr().out
    assert "R^2" in printed and "of that, the sending thread" in printed
    plan_dir = tmp_path / "plan"
    assert main(["plan", "--profile", str(out), "--model", model, "--engines", "2", "--slo", "ttft:60000",
                 "--num-prompts", "20", "--input-len", "32", "--output-len", "8", "--request-rate", "1",
                 "--output-dir", str(plan_dir), "--no-plots"]) == 0
    assert len(json.loads((plan_dir / "plan.json").read_text())["splits"]) == 2


def profile_decode_source(path) -> str:
    return load_profile(path).machine.get("decode_points", "in-process").split(":")[0]


def test_served_decode_is_refused_on_a_gpu_before_measuring(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--device", "cuda", "--served-decode", "--out", str(out)]) == 2
    assert "drop the flag" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("native_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_the_profile_resolves_auto_as_the_engines_do(model_factory, monkeypatch, capsys, native_bf16, expected):
    """auto is resolved once, before anything is measured, to the dtype `pdserve up`'s engines compute in."""
    from pdserve.engine import config
    from pdserve.planner.profile.measure import resolve_dtype

    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_dtype(model_factory(), "auto", "cpu") == expected
    assert resolve_dtype(model_factory(), "float16", "cpu") == "float16"
    assert f"computing in {expected} (auto: this CPU has" in capsys.readouterr().out


def test_on_a_gpu_every_shape_runs_once_untimed_first(monkeypatch):
    """Triton compiles per new argument specialization on a GPU: the timed pass must not pay for it."""
    import argparse

    from pdserve.planner.profile import measure as plan_profile

    calls = []

    class Probe:  # stands in for the engine: records which shapes ran, in order
        def __init__(self, model, device, budget, dtype):
            self.llm = argparse.Namespace(model_config=argparse.Namespace(max_model_len=4096, dtype="torch.bfloat16"))
            self.engine = argparse.Namespace(cache_config=argparse.Namespace(block_size=16),
                                             scheduler=argparse.Namespace(config=argparse.Namespace(max_num_seqs=8)),
                                             runner=argparse.Namespace(num_blocks=64, attn_backend=argparse.Namespace(
                                                 decode_pads_to_longest=False,
                                                 decode_groups_by_length=False)))

        def prefill_points(self, prompt_len, batch):
            calls.append(("prefill", prompt_len, batch))
            return [f"p{prompt_len}x{batch}"]

        def decode_points(self, batch, prompt_len):
            calls.append(("decode", batch, prompt_len))
            return [f"d{batch}x{prompt_len}"]

    monkeypatch.setattr(plan_profile, "EngineProbe", Probe)
    args = argparse.Namespace(device="cuda", dtype="auto", max_num_batched_tokens=2048, quick=True, repeats=1,
                              served_decode=False, in_process_decode=False)
    prefill, decode, settings, _ = plan_profile.measure_engine(args, "model")
    shapes = calls[2:]  # after the two first-step warm-ups
    half = len(shapes) // 2
    assert shapes[:half] == shapes[half:] and half == len(plan_profile.QUICK_PREFILL) + len(plan_profile.QUICK_DECODE)
    assert len(prefill) == len(plan_profile.QUICK_PREFILL) and len(decode) == len(plan_profile.QUICK_DECODE)
    assert settings.dtype == "bfloat16"
    calls.clear()
    plan_profile.measure_engine(argparse.Namespace(**{**vars(args), "device": "cpu", "in_process_decode": True}),
                                "model")
    assert len(calls) - 2 == half  # no JIT on CPU: one pass


def test_another_process_cpu_is_read_finer_than_a_clock_tick():
    """A small model's 15 decode steps take a few ms of CPU: whole 10 ms ticks read 0 (CI saw corun_cpu_s 0.0)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nend = time.thread_time() + 0.003\n"
                              "while time.thread_time() < end: pass\nsys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = process_cpu_s(child.pid)
        time.sleep(0.5)  # its start-up and 3 ms of spinning, then it waits on stdin
        spent = process_cpu_s(child.pid) - start
        assert spent > 0 and abs(spent * 100 - round(spent * 100)) > 1e-6  # not a whole number of ticks
        assert process_cpu_s(child.pid) - start == pytest.approx(spent, abs=1e-3)  # idle now: the clock stands
    finally:
        child.communicate(b"")


def test_served_decode_points_time_a_real_engine_process(model_factory):
    from pdserve.planner.profile.served import SERVED_TOKENS, served_decode_points, served_engine

    with served_engine(model_factory(), min(os.sched_getaffinity(0)), max_num_batched_tokens=64) as session:
        points = served_decode_points(session, [(1, 40), (3, 40)])
        prompts = session[2]
        first_pass = prompts.cached_tokens
        again = served_decode_points(session, [(3, 40)], warm_up=False)
    context = 40 + SERVED_TOKENS // 2
    assert [(p.batch, p.context, p.longest) for p in points + again] == [
        (1, context, context), (3, 3 * context, context), (3, 3 * context, context)]
    assert all(p.seconds > 0 and p.cpu_seconds >= 0 for p in points + again)
    # a batch's sequences differ from their first token: only base 0's blocks (from the warm-up's 16 tokens and the
    # batch of 1's 40) were found the first time; a repeat finds every prompt's two full blocks (block size 16)
    assert len({tuple(prompts.prefix(i, 40)) for i in range(3)}) == 3
    assert first_pass == 16 + 32
    assert prompts.cached_tokens - first_pass == 3 * 32


def test_the_co_run_step_alone_goes_into_a_copy_of_an_older_profile(model_factory, tmp_path, capsys):
    model = model_factory()
    older, copy = tmp_path / "older.json", tmp_path / "copy.json"
    older.write_text(synthetic_profile(model_identity(model)).model_dump_json())
    assert main(["profile", "--model", model, "--quick", "--add-corun-to", str(older), "--out", str(older)]) == 2
    assert "write the copy elsewhere" in capsys.readouterr().err
    assert main(["profile", "--model", model, "--quick", "--add-corun-to", str(older), "--out", str(copy),
                 "--verbose"]) == 0
    before, after = load_profile(older), load_profile(copy)
    assert before.decode_corun == NO_CORUN
    check_corun(after.machine["decode_corun"], shapes={"1x16": (1, 16), "2x16": (2, 16)})
    assert after.decode_corun == corun_terms(after.machine["decode_corun"], after.decode_fit.coefficients["context"])
    assert after.model_copy(update={"machine": before.machine}) == before  # nothing else changed
    assert "factors: weights x" in capsys.readouterr().out


def test_refit_fits_an_older_profiles_points_again(model_factory, tmp_path, capsys):
    """--refit measures nothing: the same points, fits made by this pdserve, everything else carried over."""
    older, refitted = tmp_path / "older.json", tmp_path / "refitted.json"
    profile = synthetic_profile(model_identity(model_factory()))
    stale = profile.prefill_fit.model_copy(update={"coefficients": {"intercept": 0.0, "tokens": 1.0, "attention": 0.0}})
    older.write_text(profile.model_copy(update={"prefill_fit": stale}).model_dump_json())
    assert main(["profile", "--refit", str(older), "--out", str(older)]) == 2
    assert "write the new one elsewhere" in capsys.readouterr().err
    assert main(["profile", "--refit", str(older), "--out", str(refitted)]) == 0
    assert load_profile(refitted) == profile
    assert f"refitted the points of {older}" in capsys.readouterr().out


def test_a_co_run_process_that_dies_loading_stops_the_step_with_its_reason(tmp_path):
    from pdserve.planner.profile.corun import PREFILL, busy_loop

    with busy_loop(PREFILL, str(tmp_path / "no-model"), min(os.sched_getaffinity(0)), 64, 16) as loop:
        with pytest.raises(RuntimeError, match="co-run process stopped"):
            loop.wait_ready()  # and no step is timed "alone" while it would still be loading


def test_served_decode_passes_alternate_their_order_and_fit_each_shapes_median(monkeypatch):
    """A slow stretch that falls on one pass (x1.5 on its first two shapes) moves no shape's point."""
    from pdserve.planner.profile import served as plan_served
    from pdserve.planner.profile.fit import DecodePoint

    shapes, calls = [(1, 16), (4, 16), (8, 64)], []
    slow_pass = 1

    def timed(session, order, warm_up=True):
        calls.append((list(order), warm_up))
        slow = {tuple(shape) for shape in order[:2]} if len(calls) - 1 == slow_pass else set()
        return [DecodePoint(batch=b, context=b * (n + 8), seconds=0.01 * b * (1.5 if (b, n) in slow else 1.0),
                            cpu_seconds=0.02 * b * (1.5 if (b, n) in slow else 1.0) + 0.001 * len(calls))
                for b, n in order]

    monkeypatch.setattr(plan_served, "served_decode_points", timed)
    points = plan_served.served_decode_passes(None, shapes, passes=3)
    assert calls == [(shapes, True), (shapes[::-1], False), (shapes, False)]  # the warm-up once
    assert [(p.batch, p.context) for p in points] == [(1, 24), (4, 96), (8, 576)]
    assert [p.seconds for p in points] == pytest.approx([0.01, 0.04, 0.08])  # the slow pass's two shapes left out
    assert [p.cpu_seconds for p in points] == pytest.approx([0.022, 0.083, 0.163])  # medians: no slowed value
    calls.clear()
    once = plan_served.served_decode_passes(None, shapes, passes=1)
    assert calls == [(shapes, True)] and [p.seconds for p in once] == pytest.approx([0.01, 0.04, 0.08])


def test_profile_reports_progress_and_a_plain_summary_in_a_log(model_factory, tmp_path):
    """Output not on a terminal (captured): one line per step with its number and the time left, then the summary
    in plain words; the fits stay in the JSON unless --verbose."""
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--model", model_factory(), "--quick",
                           "--no-corun", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    steps = re.findall(r"^pdserve profile \[(\d+)/(\d+)\] (.+) \((.+)\)$", done.stderr, re.MULTILINE)
    total = 6  # load, one timed pass, served engine's decode shapes, reference prompt, co-run, KV link
    assert [(int(n), int(of)) for n, of, _, _ in steps] == [(n, total) for n in range(1, total + 1)]
    assert steps[0][3] == "time left not known yet" and all(left.endswith(" left") for *_, left in steps[1:])
    assert "KV link" in steps[-1][2]
    printed = done.stdout
    assert re.search(r"prefill: [\d,.]+ ms for a 1,000-token prompt", printed)
    assert re.search(r"decode step at batch 8 \(512 tokens of context each\): [\d,.]+ ms", printed)
    assert re.search(r"KV link: ([\d.]+ GB/s|too fast)", printed)
    assert "R^2" not in printed and "co-run:" not in printed  # the fit details: --verbose
    assert json.loads(out.read_text())["prefill_fit"]["r2"] is not None
