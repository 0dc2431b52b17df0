"""`pdserve bench` (a subprocess) against a real `pdserve up` 1P1D cluster on the tiny model, random
prompts with --ignore-eos: every request completes with exactly the prompt and output tokens asked,
and the JSON has every key docs/benchmarking/bench.md documents."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pdserve.bench.serve_datasets import random_dataset
from pdserve.engine.tokenizer import load_tokenizer
from tests.router.conftest import REPO, UpProcess

API_KEY = "bench-test-key"
STATS = ("mean", "median", "std", "p90", "p95", "p99")
DOCUMENTED_KEYS = (
    # vLLM's flat keys
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "request_goodput",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in STATS),
    # per request
    "input_lens", "output_lens", "ttfts", "itls", "e2els", "errors",
    # goodput share, the client's CPU, and the run's settings
    "slo_attainment", "client_cpu_s", "date", "backend", "base_url", "endpoint", "model_id", "tokenizer_id",
    "dataset", "dataset_path", "num_prompts", "input_len", "output_len", "range_ratio", "prefix_len", "num_prefix_groups",
    "request_rate", "burstiness", "max_concurrency", "seed", "warmup", "request_timeout", "ignore_eos",
    "ignore_eos_sent", "min_tokens_sent", "token_id_prompts", "include_usage", "goodput", "notes",
)


@pytest.fixture(scope="module")
def cluster(model_factory, tmp_path_factory):
    up = UpProcess(model_factory("llama"), tmp_path_factory.mktemp("up-bench"), "--num-prefill", "1",
                   "--num-decode", "1",
                   env={"PDSERVE_API_KEY": API_KEY})
    yield up
    assert up.stop() == 0, up.logs()


def test_bench_against_a_disaggregated_cluster(cluster, model_factory, tmp_path):
    model = model_factory("llama")
    out = tmp_path / "run.json"
    command = [sys.executable, "-m", "pdserve", "bench", "--base-url", f"{cluster.url}/v1", "--dataset", "random",
               "--num-prompts", "6", "--input-len", "24", "--output-len", "6", "--range-ratio", "0.5", "--seed", "5",
               "--warmup", "1", "--max-concurrency", "3", "--request-rate", "20", "--ignore-eos",
               "--goodput", "ttft:60000", "tpot:60000", "--save-result", str(out), "--metadata", "config=1P1D"]
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "PDSERVE_API_KEY": ""}
    run = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr + cluster.logs()
    result = json.loads(out.read_text())
    assert set(DOCUMENTED_KEYS) <= set(result), set(DOCUMENTED_KEYS) - set(result)
    assert result["errors"] == [""] * 6 and (result["completed"], result["failed"]) == (6, 0)
    asked = random_dataset(load_tokenizer(model), 7, 24, 6, 0.5, seed=5)[1:]  # the first one was the warmup
    assert result["input_lens"] == [s.prompt_len for s in asked]
    assert result["output_lens"] == [s.output_len for s in asked]
    assert result["total_output_tokens"] == sum(s.output_len for s in asked)
    assert (result["token_id_prompts"], result["ignore_eos_sent"], result["min_tokens_sent"]) == (True, True, True)
    assert result["model_id"] == result["tokenizer_id"] == model  # from the server's /v1/models
    assert result["config"] == "1P1D" and result["slo_attainment"] == 1.0 and result["notes"] == []
    # one gap per text chunk after the first; a chunk may carry more than one token
    assert all(len(itls) <= n - 1 for itls, n in zip(result["itls"], result["output_lens"])) and any(result["itls"])
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"] and result["mean_tpot_ms"] > 0
    assert re.search(r"Completed / failed +6 / 0", run.stdout) and "TPOT" in run.stdout
