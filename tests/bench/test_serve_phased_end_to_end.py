"""`pdserve bench --dataset phased` as a subprocess against the synthetic server (bench/mock_server.py), two
short phases: every request is sent with its phase's lengths, results come per phase in the table and the
JSON, the saved trace holds the schedule, and replaying it sends the same requests in the same phases."""

from __future__ import annotations

import json

from tests.bench.test_serve_failures import bench

PHASES = "24:3:30:0.6,6:9:50:0.4"


def run_phased(fake_url, tokenizer: str, tmp_path) -> tuple[dict, list[dict], str]:
    result, trace = tmp_path / "phased.json", tmp_path / "trace.jsonl"
    run = bench("--base-url", fake_url, "--tokenizer", tokenizer, "--dataset-name", "phased", "--phases", PHASES,
                "--seed", "3", "--warmup", "1", "--ignore-eos", "--goodput", "ttft:60000",
                "--save-trace", str(trace), "--save-result", str(result), timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(result.read_text()), [json.loads(line) for line in trace.read_text().splitlines()], run.stdout


def test_a_two_phase_run_reports_each_phase_and_its_trace_replays_the_same(fake_url, model_factory, tmp_path):
    tokenizer = model_factory("llama")
    result, trace, stdout = run_phased(fake_url, tokenizer, tmp_path)
    phases = result["phases"]
    assert [(p["name"], p["spec"]) for p in phases] == [("phase 1 cycle 1", "24:3:30:0.6"),
                                                      ("phase 2 cycle 1", "6:9:50:0.4")]
    counts = [p["num_requests"] for p in phases]
    assert all(count > 0 for count in counts) and sum(counts) == result["num_prompts"] == result["completed"]
    assert result["request_phases"] == [0] * counts[0] + [1] * counts[1]  # sent in order of arrival
    # the mock server counts a token-id prompt's ids: each request had its phase's lengths
    lengths = {(i, o) for i, o in zip(result["input_lens"], result["output_lens"])}
    assert lengths == {(24, 3), (6, 9)}
    assert [p["total_output_tokens"] for p in phases] == [3 * counts[0], 9 * counts[1]]
    assert all(p["slo_attainment"] == 1.0 and p["failed"] == 0 for p in phases)
    assert (result["phase_spec"], result["phase_cycles"], result["dataset"]) == (PHASES, 1, "phased")
    assert "Per phase" in stdout and "phase 2 cycle 1  6:9:50:0.4" in stdout
    # the trace: every measured request, at its offset inside its phase's window
    assert len(trace) == result["num_prompts"]
    assert all(0 <= line["arrival_s"] < 0.6 for line in trace[:counts[0]])
    assert all(0.6 <= line["arrival_s"] < 1.0 for line in trace[counts[0]:])
    assert [line["phase"] for line in trace] == [1] * counts[0] + [2] * counts[1]

    replay_path = tmp_path / "replay.json"
    run = bench("--base-url", fake_url, "--tokenizer", tokenizer, "--dataset", "trace", "--dataset-path",
                str(tmp_path / "trace.jsonl"), "--ignore-eos", "--save-result", str(replay_path), timeout=120)
    assert run.returncode == 0, run.stderr
    replay = json.loads(replay_path.read_text())
    assert [(p["name"], p["num_requests"], p["completed"]) for p in replay["phases"]] == [
        (p["name"], p["num_requests"], p["completed"]) for p in phases]
    assert (replay["input_lens"], replay["output_lens"]) == (result["input_lens"], result["output_lens"])
    assert replay["request_phases"] == result["request_phases"] and replay["dataset"] == "trace"
