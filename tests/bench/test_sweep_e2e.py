"""`pdserve sweep` end to end on a tiny model: real `pdserve up` per layout, real `pdserve bench` runs, the
router's /metrics, summary.csv, the run JSONs and the PNGs; and the failures it survives."""

from __future__ import annotations

import html
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.bench.serve_preflight import PROBE_TOKENS
from pdserve.bench.sweep_results import SUMMARY_COLUMNS, read_csv
from pdserve.cli import main

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 16, 4
RATES = (4.0, 16.0)
UP_ARGS = "--dtype float32 --block-size 4 --num-kv-blocks 512 --max-num-batched-tokens 64 --log-level warning"
STATS = ("mean", "median", "std", "p90", "p95", "p99")
DOCUMENTED_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                   "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                   "input_lens", "output_lens", "ttfts", "itls", "errors", "config", "rate", "sweep", "server_metrics",
                   *(f"{stat}_{metric}_ms" for stat in STATS for metric in ("ttft", "tpot", "itl", "e2el"))}
PNGS = ("ttft_p90.png", "tpot_p90.png", "itl_p99.png", "slo_attainment.png", "goodput_per_engine.png")


def kv_bytes_per_token(model_dir: str) -> int:
    config = json.loads(Path(model_dir, "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # K and V, float32


def up_pids(out_dir: Path) -> list[int]:
    """The pids `pdserve up` reported for its router and engines."""
    text = "".join(path.read_text() for path in out_dir.glob("logs/*/up.out"))
    return [int(pid) for pid in re.findall(r" ready \(.*?pid (\d+)", text)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.timeout(240)
def test_sweep_two_layouts_two_rates(model_factory, tmp_path, capsys):
    model = model_factory("llama")
    out = tmp_path / "sweep"
    code = main(["sweep", "--configs", "1P1D", "0P1D", "--request-rates", *map(str, RATES), "--model", model,
                 "--num-prompts", str(NUM_PROMPTS), "--dataset", "random", "--input-len", str(INPUT_LEN),
                 "--output-len", str(OUTPUT_LEN), "--goodput", "ttft:60000", "tpot:60000", "--warmup", "2",
                 "--output-dir", str(out), "--up-args", UP_ARGS])
    assert code == 0, (out / "summary.csv").read_text()
    check_console_and_report(capsys.readouterr().out, out)

    rows = read_csv(out / "summary.csv")
    assert [(row["config"], row["request_rate"]) for row in rows] == [(c, r) for c in ("1P1D", "0P1D") for r in RATES]
    per_token = kv_bytes_per_token(model)
    for row in rows:
        assert row["error"] is None and (row["completed"], row["failed"]) == (NUM_PROMPTS, 0), row
        assert row["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
        assert row["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert row["slo_attainment"] == 1.0  # a minute-long SLO: every request meets it
        disaggregated = row["config"] == "1P1D"
        # every prompt's KV crosses the link once. Bench's one preflight request (a 1-token answer to the first
        # prompt's first PROBE_TOKENS ids) ends with the prefill engine's first token, and the router aborts its
        # decode side: its KV crosses only if the decode engine had asked for it before the abort came
        assert (row["kv_transfers"] in (NUM_PROMPTS, NUM_PROMPTS + 1)) if disaggregated else row["kv_transfers"] == 0
        # the probe's KV may have left the prefill engine after the decode side was aborted: sent, not received
        assert 0 <= row["kv_bytes_sent"] - row["kv_bytes_received"] <= PROBE_TOKENS * per_token
        if disaggregated:  # the probe's tokens travel, or come back as the first prompt's prefix hit on decode
            assert row["kv_bytes_sent"] % per_token == 0
            assert abs(row["kv_bytes_sent"] / per_token - NUM_PROMPTS * INPUT_LEN) <= PROBE_TOKENS
        else:
            assert row["kv_bytes_sent"] == 0
        assert (row["mean_kv_wait_ms"] is not None) == disaggregated
        assert row["prefix_cache_queries"] >= NUM_PROMPTS * INPUT_LEN
        assert row["server_cpu_s"] > 0  # the router's own CPU (process_cpu_seconds_total) over the run

        result = json.loads(Path(row["result_file"]).read_text())
        assert DOCUMENTED_KEYS <= set(result), DOCUMENTED_KEYS - set(result)
        assert (result["config"], float(result["rate"])) == (row["config"], row["request_rate"])
        assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
        assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
        assert len(result["itls"]) == len(result["ttfts"]) == NUM_PROMPTS
        assert result["server_metrics"]["kv_transfers"] == row["kv_transfers"]
        assert result["sweep"]["dtype"] == "float32"  # what the engines computed in (--up-args' --dtype)

    # each layout was warmed with one request per engine shaped like its runs, outside every run's metrics
    # window (the kv_transfers counts above): the 1P1D layout's two sent prompts would show in its first run
    warmups = {path.name: json.loads(path.read_text()) for path in (out / "warmup").glob("*.json")}
    assert {name: (w["completed"], w["input_lens"]) for name, w in warmups.items()} == {
        "1P1D_rateinf_warmup_sweep.json": (2, [INPUT_LEN] * 2), "0P1D_rateinf_warmup_sweep.json": (1, [INPUT_LEN])}

    goodput = read_csv(out / "goodput.csv")
    assert [(g["config"], g["goodput"], g["goodput_per_engine"]) for g in goodput] == [
        ("1P1D", max(RATES), max(RATES) / 2), ("0P1D", max(RATES), max(RATES))]

    from matplotlib.image import imread

    for name in PNGS:
        assert imread(out / name).shape[0] > 100
    pids = up_pids(out)
    assert len(pids) == 3 + 2  # router + 2 engines, router + 1 engine
    assert not [pid for pid in pids if alive(pid)]  # every layout was stopped
    validate_with_plan(model, out, tmp_path)


def check_console_and_report(output: str, out: Path) -> None:
    """Output not a terminal: a line as each run starts (its place in the matrix, what it is, the time left) and
    one with its results; no bench table; the comparison with its winner, in summary.md too; report.html whole."""
    starts = re.findall(r"^\[pdserve sweep\] \[(\d+)/6\] (.*) \((?:about \w+ left|time left not known yet)\)$",
                        output, re.M)
    assert starts == [(str(i + 1), label) for i, label in enumerate([
        "1P1D warm-up: 2 unmeasured request(s) shaped like the runs", "1P1D at 4 req/s", "1P1D at 16 req/s",
        "0P1D warm-up: 1 unmeasured request(s) shaped like the runs", "0P1D at 4 req/s", "0P1D at 16 req/s"])], output
    done = re.findall(r"^\[pdserve sweep\] (0P1D at 16 req/s): 4/4 requests in [\d.]+ s, 100% within the SLOs, "
                      r"TTFT p90 \d+ ms, TPOT p90 \d+ ms$", output, re.M)
    assert done == ["0P1D at 16 req/s"], output
    assert "Request throughput (req/s)" not in output and "bench at rate" not in output  # the tables stay in runs/
    # the same goodput in total (16 req/s, met at every rate), over 1 engine against 2
    winner = ("0P1D wins: at least 16 req/s per engine (16 in total on 1) against 1P1D's at least 8 req/s per engine "
              "(16 in total on 2), 2.00x (+100%).")
    assert winner in output
    summary = (out / "summary.md").read_text()
    assert winner in summary and "| 0P1D (winner) | 1 | >= 16 | >= 16 | 100% | 100% |" in summary, summary
    assert "| 1P1D | 2 | >= 16 | >= 8 | 100% | 100% |" in summary
    assert summary.split("\n| layout")[1].split("\n\n")[0] in output  # the table as the console showed it
    page = (out / "report.html").read_text()
    assert html.escape(winner) in page and page.count('src="data:image/png;base64,') == len(PNGS)
    assert not re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)  # nothing fetched
    assert "http://" not in page.replace("http://127.0.0.1:PORT", "") and "https://" not in page
    assert "pdserve up --model" in page and "TTFT &lt;= 60000 ms" in page


def validate_with_plan(model: str, sweep_dir: Path, tmp_path: Path) -> None:
    """`pdserve plan --validate` replays this sweep: every (config, rate) point, predicted against measured."""
    from pdserve.planner.profile.fit import EngineSettings, model_identity
    from tests.planner.helpers import synthetic_profile

    profile = synthetic_profile(model_identity(model)).model_copy(
        update={"engine": EngineSettings(block_size=4, num_kv_blocks=512, max_num_batched_tokens=64)})
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(profile.model_dump_json())
    out = tmp_path / "validation"
    assert main(["plan", "--profile", str(profile_path), "--validate", str(sweep_dir), "--output-dir", str(out)]) == 0
    result = json.loads((out / "validation.json").read_text())
    points = {(p["config"], p["request_rate"]) for p in result["points"]}
    assert points == {(c, r) for c in ("1P1D", "0P1D") for r in RATES}
    assert result["summary"]["attainment_mae_pp"] == 0.0  # a minute-long SLO: met in the sweep and predicted
    assert all(p["predicted_median_ttft_ms"] > 0 for p in result["points"])
    assert (out / "validation.png").stat().st_size > 0


@pytest.mark.timeout(180)
def test_slos_come_from_the_unloaded_pass_of_the_same_sweep(model_factory, tmp_path):
    """--slo-factors: each layout first serves a few requests one at a time; the SLOs are factors of the
    lowest unloaded median, bench gets them as --goodput, and every row's attainment is judged by them."""
    out = tmp_path / "sweep"
    code = main(["sweep", "--configs", "0P1D", "--request-rates", "8", "--model", model_factory("llama"),
                 "--num-prompts", "3", "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                 "--slo-factors", "ttft:1000", "tpot:1.0", "--unloaded-prompts", "2", "--warmup", "1",
                 "--output-dir", str(out), "--up-args", UP_ARGS, "--no-plots"])
    assert code == 0, (out / "summary.csv").read_text()
    unloaded, loaded = read_csv(out / "summary.csv")
    assert (unloaded["phase"], unloaded["max_concurrency"], unloaded["completed"]) == ("unloaded", 1, 2)
    assert (loaded["phase"], loaded["request_rate"], loaded["completed"]) == ("sweep", 8.0, 3)
    basis = json.loads((out / "slos.json").read_text())
    assert basis["ttft"]["slo_ms"] == math.ceil(1000 * unloaded["median_ttft_ms"])
    assert basis["tpot"]["slo_ms"] == math.ceil(unloaded["median_tpot_ms"])
    assert basis["tpot"]["from_config"] == "0P1D"
    result = json.loads(Path(loaded["result_file"]).read_text())
    assert result["goodput"] == {"ttft": basis["ttft"]["slo_ms"], "tpot": basis["tpot"]["slo_ms"]}
    # the layout started twice (unloaded pass, then the loads), and was warmed each time
    assert sorted(path.name for path in (out / "warmup").iterdir()) == [
        "0P1D_rateinf_warmup_sweep.json", "0P1D_rateinf_warmup_unloaded.json"]
    # TPOT SLO = the unloaded median (of two requests: their mean, rounded up to a whole ms): the faster
    # request meets it, the slower one only when it is within that rounding
    assert unloaded["slo_attainment"] in (0.5, 1.0) and loaded["slo_attainment"] is not None


@pytest.mark.timeout(180)
def test_reference_runs_around_every_load_and_plan_reads_them(model_factory, tmp_path):
    """--reference-requests: before each load and after the last, a few requests one at a time of their own
    length, numbered in the server's order; `plan --validate --per-point-speed` scales each point by them."""
    model = model_factory("llama")
    out = tmp_path / "sweep"
    code = main(["sweep", "--configs", "0P1D", "--request-rates", "8", "16", "--model", model, "--num-prompts", "3",
                 "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--goodput", "ttft:60000",
                 "--reference-requests", "2", "--reference-output-len", "6", "--warmup", "0",
                 "--output-dir", str(out), "--up-args", UP_ARGS])
    assert code == 0, (out / "summary.csv").read_text()
    rows = read_csv(out / "summary.csv")
    assert [(row["phase"], row["request_rate"]) for row in rows] == [
        ("reference", math.inf), ("sweep", 8.0), ("reference", math.inf), ("sweep", 16.0), ("reference", math.inf)]
    runs = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    assert sorted(runs) == ["0P1D_rate16", "0P1D_rate8", "0P1D_reference0", "0P1D_reference1", "0P1D_reference2"]
    for number in range(3):
        reference = runs[f"0P1D_reference{number}"]
        assert (reference["completed"], reference["max_concurrency"]) == (2, 1)
        assert reference["output_lens"] == [6, 6] and reference["input_lens"] == [INPUT_LEN] * 2
        assert reference["sweep"]["order"] == 2 * number
    assert (runs["0P1D_rate8"]["sweep"]["order"], runs["0P1D_rate16"]["sweep"]["order"]) == (1, 3)
    assert runs["0P1D_rate8"]["output_lens"] == [OUTPUT_LEN] * 3  # the loads keep their own length
    assert [g["goodput"] for g in read_csv(out / "goodput.csv")] == [16.0]  # references are no load

    from pdserve.planner.profile.fit import EngineSettings, model_identity
    from tests.planner.helpers import synthetic_profile

    profile = synthetic_profile(model_identity(model)).model_copy(
        update={"engine": EngineSettings(block_size=4, num_kv_blocks=512, max_num_batched_tokens=64)})
    (tmp_path / "profile.json").write_text(profile.model_dump_json())
    assert main(["plan", "--profile", str(tmp_path / "profile.json"), "--validate", str(out), "--per-point-speed",
                 "--diagnose", "--output-dir", str(tmp_path / "validation"), "--no-plots"]) == 0
    points = json.loads((tmp_path / "validation" / "validation.json").read_text())["points"]
    assert sorted(p["request_rate"] for p in points) == [8.0, 16.0]
    assert all(p["reference_speed_prefill"] > 0 and p["reference_speed_decode"] > 0 for p in points)


@pytest.mark.timeout(120)
def test_a_layout_that_cannot_start_and_a_dead_server_are_rows_with_errors(tmp_path):
    out = tmp_path / "sweep"
    code = main(["sweep", "--configs", "1P1D", "--model", str(tmp_path / "no-such-model"), "--request-rates", "1",
                 "--num-prompts", "2", "--base-url", "dead=http://127.0.0.1:9", "--output-dir", str(out),
                 "--startup-timeout", "60", "--no-plots", "--warmup", "0", "--goodput", "ttft:1000", "--find-goodput"])
    assert code == 1
    rows = read_csv(out / "summary.csv")
    assert list(rows[0]) == SUMMARY_COLUMNS
    # the goodput search stops at its first failed run instead of halving the rate
    assert [(row["config"], row["phase"]) for row in rows] == [("1P1D", "start"), ("dead", "sweep"),
                                                               ("dead", "search")]
    assert not (out / "goodput.csv").exists()
    assert "pdserve up for 1P1D exited" in rows[0]["error"]
    assert "pdserve bench exited" in rows[1]["error"] and rows[1]["completed"] is None
    assert math.isnan(rows[0]["request_rate"])
    assert not list(out.glob("*.png"))


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_layout_and_keeps_what_was_measured(model_factory, tmp_path):
    """SIGINT to the sweep's process group, as a terminal's Ctrl-C sends it, in the middle of a run."""
    out = tmp_path / "sweep"
    argv = ["sweep", "--configs", "0P1D", "--request-rates", "0.5", "--num-prompts", "40", "--input-len", "16",
            "--output-len", "4", "--model", model_factory("llama"), "--output-dir", str(out), "--warmup", "0",
            "--no-plots", "--up-args", UP_ARGS]
    # SIGINT as a terminal leaves it (a runner that starts us in the background may have it ignored, and an
    # ignored signal stays ignored across exec)
    process = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if " 0P1D at 0.5 req/s (" in line:  # the run starts
                break
        time.sleep(3)  # into the run
        os.killpg(process.pid, signal.SIGINT)
        try:  # bounded by the sweep's own waits: bench killed, /metrics read (10 s), `up` stopped (30 s)
            rest, _ = process.communicate(timeout=150)
        except subprocess.TimeoutExpired as exc:
            up_out = (out / "logs" / "0P1D" / "up.out")
            raise AssertionError(f"the sweep did not end within 150 s of Ctrl-C; its output:\n{''.join(lines)}"
                                 f"{exc.output or ''}\nup.out:\n{up_out.read_text() if up_out.exists() else ''}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines) + rest
    assert process.returncode == 130, output
    assert "interrupted: writing what was measured" in output
    assert (out / "summary.csv").exists()
    pids = up_pids(out)
    assert len(pids) == 2 and not [pid for pid in pids if alive(pid)], output
    assert "[pdserve up] stopped" in (out / "logs" / "0P1D" / "up.out").read_text()


@pytest.mark.timeout(240)
def test_a_phased_sweep_runs_the_adaptive_layout_beside_a_static_one(model_factory, tmp_path):
    """`--configs 0P2D adaptive`: two colocated engines, then two dual-role engines under the adaptive router; a
    shifting load (long prompts, then long answers) per layout, every request answered, the phases reported."""
    model = model_factory("llama")
    out = tmp_path / "sweep"
    code = main(["sweep", "--configs", "0P2D", "adaptive", "--request-rates", "inf", "--model", model,
                 "--dataset", "phased", "--phases", "48:2:8:0.5,8:12:8:0.5", "--ignore-eos",
                 "--goodput", "ttft:60000", "tpot:60000", "--warmup", "0", "--output-dir", str(out),
                 "--up-args", UP_ARGS])
    assert code == 0, (out / "summary.csv").read_text()
    rows = read_csv(out / "summary.csv")
    assert [row["config"] for row in rows] == ["0P2D", "adaptive"]
    for row in rows:
        result = json.loads(Path(row["result_file"]).read_text())
        assert row["error"] is None and row["failed"] == 0 and row["completed"] == len(result["input_lens"]) > 0, row
        assert sorted(set(result["input_lens"])) == [8, 48] and sorted(set(result["output_lens"])) == [2, 12]
        assert [(phase["phase"], phase["completed"]) for phase in result["phases"]] == [
            (1, result["input_lens"].count(48)), (2, result["input_lens"].count(8))], result["phases"]
        assert result["sweep"]["num_engines"] == 2
    summary = (out / "summary.md").read_text()
    per_phase = summary.split("## Per phase")[1]
    for phase in ("1 (48:2:8:0.5)", "2 (8:12:8:0.5)"):
        assert all(f"| {phase} | {config} |" in per_phase for config in ("0P2D", "adaptive")), per_phase
        assert f"- Phase {phase}: " in per_phase
