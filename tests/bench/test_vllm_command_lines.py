"""The example command lines of vLLM's benchmark docs (`vllm bench serve ...`) run as `pdserve bench ...`
against the synthetic server (bench/mock_server.py), with only the port, the model and the data files
rewritten: they run, and their result files and metrics are the ones vLLM's flags ask for. vLLM's flags
that pdserve cannot honour are refused in one line that says why."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def fake_port(fake_url):
    return fake_url.rsplit(":", 1)[1]


def vllm_bench(cwd, command: str, **rewrites: str) -> subprocess.CompletedProcess:
    """Runs a `vllm bench serve` line as `pdserve bench`, after replacing each {NAME} in it."""
    argv = command.format(**rewrites).split()
    assert argv[:3] == ["vllm", "bench", "serve"]
    return subprocess.run([sys.executable, "-m", "pdserve", "bench", *argv[3:]], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_sharegpt_example(fake_port, model_factory, tmp_path):
    turns = [("Tell me about the sea and its waves today", "The sea is wide and the waves roll in again"),
             ("Write a short poem about a quiet winter night", "Snow falls softly on the sleeping town tonight")]
    (tmp_path / "ShareGPT.json").write_text(json.dumps(
        [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in turns]))
    run = vllm_bench(tmp_path, "vllm bench serve --port {port} --backend vllm --model {model} "
                     "--endpoint /v1/completions --dataset-name sharegpt --dataset-path {data} --num-prompts 10 "
                     "--save-result", port=fake_port, model=model_factory(), data=str(tmp_path / "ShareGPT.json"))
    assert run.returncode == 0, run.stderr
    [saved] = list(tmp_path.glob("openai-infqps-*.json"))  # vLLM's name: backend, rate, model, date
    result = json.loads(saved.read_text())
    assert (result["completed"], result["failed"], result["dataset"]) == (10, 0, "sharegpt")
    assert result["base_url"] == f"http://127.0.0.1:{fake_port}" and result["endpoint"] == "/v1/completions"


def test_the_random_example_with_percentiles_goodput_and_result_dir(fake_port, model_factory, tmp_path):
    run = vllm_bench(tmp_path, "vllm bench serve --port {port} --model {model} --dataset-name random "
                     "--random-input-len 100 --random-output-len 20 --random-range-ratio 0.1 --num-prompts 12 "
                     "--request-rate 50 --max-concurrency 4 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el "
                     "--metric-percentiles 50,90,99.9 --goodput ttft:5000 tpot:1000 --save-result "
                     "--result-dir {out} --label mock --seed 3", port=fake_port, model=model_factory(),
                     out=str(tmp_path / "results"))
    assert run.returncode == 0, run.stderr
    [saved] = list((tmp_path / "results").glob("mock-50qps-concurrency4-*.json"))
    result = json.loads(saved.read_text())
    assert result["completed"] == 12 and result["label"] == "mock" and result["seed"] == 3
    assert all(90 <= n <= 110 for n in result["input_lens"]) and all(18 <= n <= 22 for n in result["output_lens"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"p99.9_{metric}_ms"] >= result[f"p50_{metric}_ms"] >= 0
        assert f"p90.0_{metric}_ms" not in result  # p90 is always written, as p90_{metric}_ms
    assert result["slo_attainment"] == 1.0 and result["request_goodput"] > 0


def test_the_custom_dataset_example(fake_port, model_factory, tmp_path):
    """vLLM's custom JSONL carries prompts only; --custom-output-len gives every request's length."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n"
                                                 for i in range(5)))
    run = vllm_bench(tmp_path, "vllm bench serve --port {port} --save-result --save-detailed --backend vllm "
                     "--model {model} --endpoint /v1/completions --dataset-name custom --dataset-path {data} "
                     "--skip-chat-template --custom-output-len 16 --num-prompts 8 --result-filename custom.json",
                     port=fake_port, model=model_factory(), data=str(tmp_path / "data.jsonl"))
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "custom.json").read_text())
    assert result["dataset"] == "jsonl" and result["output_lens"] == [16] * 8


def test_the_prefix_repetition_example(fake_port, model_factory, tmp_path):
    run = vllm_bench(tmp_path, "vllm bench serve --port {port} --backend openai --model {model} "
                     "--dataset-name prefix_repetition --num-prompts 20 --prefix-repetition-prefix-len 64 "
                     "--prefix-repetition-suffix-len 16 --prefix-repetition-num-prefixes 5 "
                     "--prefix-repetition-output-len 8 --ignore-eos --save-result --result-filename prefix.json",
                     port=fake_port, model=model_factory())
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "prefix.json").read_text())
    assert (result["dataset"], result["prefix_len"], result["num_prefix_groups"]) == ("prefix", 64, 5)
    assert result["input_lens"] == [80] * 20 and result["output_lens"] == [8] * 20


def test_the_chat_backend_goes_to_the_chat_endpoint(fake_port, model_factory, tmp_path):
    run = vllm_bench(tmp_path, "vllm bench serve --port {port} --backend openai-chat --model {model} "
                     "--dataset-name random --random-input-len 20 --random-output-len 4 --num-prompts 3 "
                     "--disable-tqdm --save-result chat.json", port=fake_port, model=model_factory())
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "chat.json").read_text())
    assert result["endpoint"] == "/v1/chat/completions" and result["completed"] == 3


@pytest.mark.parametrize("flags, says", [
    ("--append-result", "pdserve writes one JSON per run"),
    ("--dataset-name sonnet", "pdserve bench has random, sharegpt, prefix"),
    ("--backend openai-audio", "pdserve bench speaks the OpenAI API"),
    ("--ramp-up-strategy linear --ramp-up-start-rps 1 --ramp-up-end-rps 5", "pdserve sweep --request-rates"),
    ("--temperature 0.7", "greedy requests"),
    ("--hf-split train", "reads local files only"),
])
def test_what_pdserve_cannot_do_is_refused_with_the_reason(tmp_path, flags, says):
    run = vllm_bench(tmp_path, f"vllm bench serve --port 9 --num-prompts 1 {flags}")
    assert run.returncode == 2 and run.stdout == ""
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve bench: error: argument ") and says in last, run.stderr
    assert not list(tmp_path.iterdir()), "nothing is written"


def test_vllm_names_and_pdserve_names_are_one_setting():
    from pdserve.cli import build_parser

    parser = build_parser()
    vllm = parser.parse_args(["bench", "--dataset-name", "prefix_repetition", "--random-input-len", "7",
                              "--prefix-repetition-prefix-len", "3", "--prefix-repetition-num-prefixes", "2",
                              "--num-warmups", "5", "--disable-tqdm", "--random-range-ratio", "0.5"])
    ours = parser.parse_args(["bench", "--dataset", "prefix", "--input-len", "7", "--prefix-len", "3",
                              "--num-prefix-groups", "2", "--warmup", "5", "--disable-progress", "--range-ratio", "0.5"])
    assert vars(vllm) == vars(ours)
