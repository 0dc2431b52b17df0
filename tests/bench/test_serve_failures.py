"""`pdserve bench` as a subprocess against the synthetic server (bench/mock_server.py): 500s,
dropped connections and stalls are counted with their reasons and the run ends; refused fields are
dropped with a note; an unreachable server or a bad file is one error line before any load."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.router.conftest import REPO

READY_TIMEOUT_S = 30


def start_fake_server(*args: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mock_server", "--port", "0", *args],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("FAKE_OPENAI_READY"):
        process.kill()
        raise RuntimeError(f"the fake server did not start: {line!r}")
    return process, line.split("url=")[1].strip()


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "bench", "--disable-progress", *args], check=False,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def write_jsonl(path, prompts: list[str], output_len: int = 6) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "output_len": output_len}) + "\n" for p in prompts))
    return str(path)


def test_failures_are_counted_with_their_reasons_and_the_run_ends(fake_url, tmp_path):
    prompts = ["fine one", "x [fault:500]", "fine two", "x [fault:drop]", "x [fault:stall]"]
    out = tmp_path / "result.json"
    started = time.monotonic()
    run = bench("--base-url", fake_url, "--dataset", "jsonl", "--dataset-path", write_jsonl(tmp_path / "p.jsonl", prompts),
                "--num-prompts", "5", "--request-timeout", "1", "--save-result", str(out))
    assert run.returncode == 0, run.stderr
    assert time.monotonic() - started < 30
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (2, 3)
    errors = result["errors"]
    assert errors[0] == errors[2] == ""
    assert errors[1] == "HTTP 500: injected failure"
    assert errors[3].startswith("connection dropped: ")
    assert errors[4] == "stalled: no data for 1 s (--request-timeout)"
    assert result["output_lens"][0] == result["output_lens"][2] == 6 and result["total_output_tokens"] == 12
    assert "Failures:" in run.stdout and "1 x HTTP 500: injected failure" in run.stdout


def test_a_run_where_nothing_completes_exits_1_and_still_writes_its_json(fake_url, tmp_path):
    out = tmp_path / "result.json"
    run = bench("--base-url", fake_url, "--dataset", "jsonl", "--num-prompts", "3", "--save-result", str(out),
                "--dataset-path", write_jsonl(tmp_path / "p.jsonl", ["[fault:500]"]))
    assert run.returncode == 1, run.stderr
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (0, 3) and result["mean_ttft_ms"] == 0.0


def test_refused_fields_are_dropped_once_with_a_note(model_factory, tmp_path):
    process, url = start_fake_server("--refuse", "ignore_eos", "--refuse", "token_ids")
    try:
        out = tmp_path / "result.json"
        run = bench("--base-url", url, "--tokenizer", model_factory("llama"), "--num-prompts", "4", "--input-len", "8",
                    "--output-len", "5", "--ignore-eos", "--save-result", str(out))
    finally:
        process.kill()
        process.wait()
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stderr.splitlines() if "the server refused" in line]
    assert len(notes) == 2, run.stderr
    assert "prompts as token ids; sending their text (HTTP 400: prompt must be a string)" in notes[0]
    assert "ignore_eos; output lengths are up to the model" in notes[1]
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["output_lens"] == [5] * 4
    assert (result["ignore_eos"], result["ignore_eos_sent"], result["token_id_prompts"]) == (True, False, False)
    assert [note for note in result["notes"] if note.startswith("the server refused")] == [
        line.removeprefix("pdserve bench: ") for line in notes]


def test_an_unreachable_server_is_one_error_line_before_any_load(tmp_path):
    started = time.monotonic()
    run = bench("--base-url", "http://127.0.0.1:9", "--dataset", "jsonl", "--dataset-path", str(tmp_path / "none"))
    assert run.returncode != 0
    assert time.monotonic() - started < 20
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve bench: error: cannot reach the server at "
                                                   "http://127.0.0.1:9"), run.stderr
    assert "start it, or fix --base-url" in lines[0]


def test_a_bad_dataset_line_is_one_error_line_naming_file_and_line(fake_url, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "output_len": 3}\n{"prompt": "b", "output_len": -1}\n')
    run = bench("--base-url", fake_url, "--dataset", "jsonl", "--dataset-path", str(path))
    assert run.returncode != 0 and run.stdout == ""
    expected = (f'pdserve bench: error: {path}: line 2: "output_len" must be a whole number of tokens, at least 1 '
                '(got -1): write {"prompt": "text", "output_len": N}')
    assert [line for line in run.stderr.splitlines() if "error" in line] == [expected]


def test_ctrl_c_reports_and_saves_the_requests_that_had_ended_and_exits_130(fake_url, tmp_path):
    import signal

    out = tmp_path / "result.json"
    prompts = ["fine one", "x [fault:stall]", "fine two", "y [fault:stall]"]  # two end at once, two never do
    process = subprocess.Popen([sys.executable, "-m", "pdserve", "bench", "--disable-progress", "--base-url", fake_url,
                                "--dataset", "jsonl", "--dataset-path", write_jsonl(tmp_path / "p.jsonl", prompts),
                                "--num-prompts", "4", "--save-result", str(out)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               # SIGINT as a terminal leaves it: a runner that starts the tests in the background
                               # has it ignored, and a child would inherit that
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        assert "no tokenizer" in process.stderr.readline()  # the run has started: the load follows in moments
        time.sleep(3)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "Completed / failed               2 / 0" in stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["errors"]) == (2, 0, ["", ""])
    assert result["notes"] == ["interrupted (Ctrl-C) after 2 of 4 measured requests ended: the metrics cover those"]
