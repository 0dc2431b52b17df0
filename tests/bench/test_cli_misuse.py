"""`pdserve bench`, `plan` and `sweep` given careless arguments or files: one line naming the flag or file and
the fix, a non-zero exit, and nothing measured or started first (a load's results are not lost at the end)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import main
from tests.planner.helpers import synthetic_profile

REPO = Path(__file__).resolve().parents[2]


def error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve {command}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def profile_path(tmp_path) -> Path:
    from pdserve.planner.profile.fit import model_identity
    from pdserve.demo_model import make_demo_model

    model = make_demo_model(tmp_path / "model", size="tiny")
    path = tmp_path / "profile.json"
    path.write_text(synthetic_profile(model_identity(model)).model_dump_json())
    return path


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_bench_refuses_a_save_result_path_it_could_not_write_before_any_load(tmp_path, capsys, where):
    (tmp_path / "file").write_text("mine")
    path = tmp_path if where == "a directory" else tmp_path / "file" / "result.json"
    # nothing listens on the port: the path is refused before the server is even asked
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--save-result", str(path)]) == 2
    err = error_line(capsys, "bench")
    assert "--save-result" in err and ("is a directory" in err or "is a file" in err)


def test_bench_refuses_a_rate_whose_arrivals_would_take_more_than_a_day(capsys):
    # was: taken, then a wait of about 1e300 s for the second request; nothing listens on the port
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--request-rate", "1e-300", "--num-prompts", "5"]) == 2
    err = error_line(capsys, "bench")
    assert "--request-rate 1e-300" in err and "4e+300 s" in err and "raise --request-rate, or use inf" in err


def test_plan_simulates_a_rate_whose_arrivals_take_more_than_a_day(profile_path, tmp_path, capsys):
    # bench's one-day bound is not plan's: a simulated day costs nothing
    assert main(["plan", "--profile", str(profile_path), "--engines", "2", "--slo", "ttft:5000", "--no-plots",
                 "--num-prompts", "5", "--output-dir", str(tmp_path / "out"), "--request-rate", "1e-5"]) == 0


@pytest.mark.parametrize("rate", ["-1", "0"])
def test_plan_names_target_rate_when_it_is_not_a_rate(profile_path, tmp_path, capsys, rate):
    assert main(["plan", "--profile", str(profile_path), "--engines", "2", "--slo", "ttft:5000", "--no-plots",
                 "--num-prompts", "5", "--output-dir", str(tmp_path / "out"), "--target-rate", rate]) == 2
    assert error_line(capsys, "plan").startswith(f"pdserve plan: error: --target-rate {rate}")


def test_plan_names_a_profile_that_is_not_text(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_bytes(b"\xff\xfe\x00")
    assert main(["plan", "--profile", str(path), "--engines", "2", "--slo", "ttft:5000"]) == 2
    assert f"{path} is not a pdserve profile" in error_line(capsys, "plan")


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "not a sweep run"),
    ('{"config": "1P1D", ', "cannot read the sweep run"),
    (b"\xff\xfe", "cannot read the sweep run"),
    ('{"config": "1P1D", "sweep": {"num_decode": 1}, "ttfts": [0.1]}', "lacks request_rate, input_lens"),
])
def test_plan_validate_names_a_run_file_it_cannot_replay(profile_path, tmp_path, capsys, content, says):
    runs = tmp_path / "sweep" / "runs"
    runs.mkdir(parents=True)
    run = runs / "1P1D_rate1.json"
    run.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["plan", "--profile", str(profile_path), "--validate", str(tmp_path / "sweep"), "--no-plots",
                 "--output-dir", str(tmp_path / "out")]) == 2
    err = error_line(capsys, "plan")
    assert says in err and ("run the sweep again" in err)
    assert str(run) in err or str(runs) in err


@pytest.mark.parametrize("flag, value", [("--metrics-interval", "0"), ("--startup-timeout", "-1"),
                                         ("--run-timeout", "0")])
def test_sweep_refuses_seconds_that_cannot_work_before_starting_anything(tmp_path, capsys, flag, value):
    assert main(["sweep", "--model", str(tmp_path), "--request-rates", "1", "--no-plots",
                 "--output-dir", str(tmp_path / "out"), flag, value]) == 2
    assert flag in error_line(capsys, "sweep")
    assert not (tmp_path / "out").exists()


SIGTERM_DURING_SWEEP = """
import os, signal, sys, time
from pdserve.bench import sweep
from pdserve.cli import build_parser

def run(self):
    self.plan.output_dir.mkdir(parents=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    finally:
        print("cleaned up", flush=True)  # where each `pdserve up` is stopped (Cluster.__exit__)

sweep.Sweep.run = run
args = build_parser().parse_args(["sweep", "--model", sys.argv[1], "--request-rates", "1", "--no-plots",
                                  "--output-dir", sys.argv[2]])
sys.exit(sweep.run_sweep(args))
"""


def test_sigterm_stops_a_sweep_like_ctrl_c(tmp_path):
    result = subprocess.run([sys.executable, "-c", SIGTERM_DURING_SWEEP, str(tmp_path), str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr
    assert "cleaned up" in result.stdout and "interrupted" in result.stderr


@pytest.mark.parametrize("argv, says", [(["--out", "."], "--out . is a directory"), (["--repeats", "0"], "--repeats 0")])
def test_profile_refuses_what_would_waste_its_measurements_before_measuring(tmp_path, capsys, monkeypatch, argv, says):
    import pdserve.planner.profile.measure

    def measured(_args):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(pdserve.planner.profile.measure, "run_profile", measured)
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "--model", str(tmp_path), *argv]) == 2
    assert says in error_line(capsys, "profile")
