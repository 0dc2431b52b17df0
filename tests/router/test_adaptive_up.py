"""`pdserve up --num-engines 2 --adaptive` as real processes (two dual-role engines, the router's adaptive policy),
driven through the real openai client: greedy output equals the offline engine's for requests the policy sends
down each path (colocated on one engine; one engine prefilling for the other), /metrics counts both (the one
transfer once on each side, with its exact bytes), and no engine holds a KV block after.

The step profile is written for the test (prompt tokens dear, decode steps growing with the batch, the KV link
free) and the SLOs are loose, so the choices follow from the harm alone: idle engines colocate (on the first
address); a prompt whose prefix engine A holds, while A decodes another request, is prefilled on A (few tokens
to compute) and decoded on idle B."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.router.conftest import openai_client, scrape, up_cluster, wait_no_kv_used

MAX_TOKENS = 12
PREFIX = "def main():\n    parser = argparse.ArgumentParser(description='a tool')\n" * 3
PROFILE = {
    "model": {"kv_bytes_per_token": 1},
    "engine": {"max_num_batched_tokens": 64},
    "prefill_fit": {"coefficients": {"intercept": 0.0, "tokens": 0.05, "attention": 0.0}},
    "decode_fit": {"coefficients": {"intercept": 0.01, "batch": 0.05, "context": 0.0001}},
    "transfer_fit": {"coefficients": {"intercept": 0.0, "bytes": 0.0}},
}


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    profile = tmp_path_factory.mktemp("adaptive-profile") / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    yield from up_cluster(tiny_model, tmp_path_factory, "up-adaptive", "--num-engines", "2", "--adaptive",
                          "--slo", "ttft:1000000", "tpot:1000000", "--step-profile", str(profile),
                          "--max-restarts", "0")


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def complete(client, model, prompt, max_tokens=MAX_TOKENS, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True}, **extra)


def assert_greedy_parity(offline, response, max_tokens=MAX_TOKENS) -> None:
    from pdserve import SamplingParams

    choice = response.choices[0]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    expected = offline.generate({"prompt_token_ids": prompt_ids},
                                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0].outputs[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.text == expected.text


def decisions(url: str) -> dict[str, float]:
    samples = scrape(url).get("pdserve_router_routing_decisions_total", {})
    return {dict(labels)["path"]: value for labels, value in samples.items()}


def nonzero(samples: dict[tuple, float]) -> dict[tuple[str, str], float]:
    """A per-engine counter's non-zero series as {(engine, role): value}."""
    return {(dict(labels)["engine"], dict(labels)["role"]): value for labels, value in samples.items() if value}


def sweep_counters(url: str) -> dict:
    """The KV columns `pdserve sweep` would record for everything since the engines started."""
    from pdserve.bench.sweep_metrics import counter_deltas, counters_by_engine, scrape_metrics, summarize_counters

    return summarize_counters(counter_deltas({}, counters_by_engine(scrape_metrics(url))))


def wait_ledger_empty(url: str, timeout: float = 10.0) -> None:
    """Until the router has no request open on any engine (its ledger, /metrics' pdserve_engine_requests_in_flight)."""
    deadline = time.monotonic() + timeout
    while any(scrape(url)["pdserve_engine_requests_in_flight"].values()):
        assert time.monotonic() < deadline, "a finished request stayed open in the router's ledger"
        time.sleep(0.02)


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V x layers x kv heads x head_dim x 4 (float32, ENGINE_ARGS)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def test_each_path_the_policy_takes_matches_the_offline_engine(cluster, client, offline, tiny_model):
    metrics = scrape(cluster.url)
    assert len(metrics["pdserve_kv_blocks_total"]) == 2, "each dual-role engine is one engine in /metrics"
    first = complete(client, tiny_model, PREFIX)
    assert_greedy_parity(offline, first)
    assert decisions(cluster.url) == {"local": 1.0, "disaggregated": 0.0}, "idle engines colocate"
    wait_ledger_empty(cluster.url)  # the first request's stream closes in the router's ledger

    long_stream = client.completions.create(model=tiny_model, prompt="import os\n" * 4, max_tokens=300,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    streamed: list[str] = []
    next(iter(long_stream))  # decoding now, on the engine that prefilled PREFIX (first address, idle: colocated)
    reader = threading.Thread(target=lambda: streamed.extend(chunk.choices[0].text for chunk in long_stream))
    reader.start()
    second = complete(client, tiny_model, PREFIX + "    args = parser.parse_args()\n")
    reader.join(timeout=120)
    assert_greedy_parity(offline, second)
    assert decisions(cluster.url) == {"local": 2.0, "disaggregated": 1.0}, \
        "the prompt whose prefix the busy engine holds is prefilled there and decoded on the idle one"
    metrics = scrape(cluster.url)
    transfers = nonzero(metrics["pdserve_kv_transfers_total"])
    sides = {role: engine for engine, role in transfers}
    assert sorted(transfers.values()) == [1.0, 1.0] and set(sides) == {"prefill", "decode"}, \
        f"one transfer, once on each side: {transfers}"
    prefilled_on, decoded_on = sides["prefill"], sides["decode"]
    assert prefilled_on != decoded_on, "one engine prefilled for the other"
    num_prompt_tokens = len(second.choices[0].model_extra["prompt_token_ids"])
    num_bytes = kv_bytes_per_token(tiny_model) * num_prompt_tokens  # the whole prompt: D had none of it cached
    assert nonzero(metrics["pdserve_kv_bytes_sent_total"]) == {(prefilled_on, "prefill"): num_bytes}
    assert nonzero(metrics["pdserve_kv_bytes_received_total"]) == {(decoded_on, "decode"): num_bytes}
    swept = sweep_counters(cluster.url)  # as `pdserve sweep` reads the run
    assert (swept["kv_transfers"], swept["kv_bytes_sent"], swept["kv_bytes_received"]) == (1, num_bytes, num_bytes)
    assert swept["mean_kv_wait_ms"] > 0 and swept["mean_kv_transfer_exposed_ms"] >= 0
    used = wait_no_kv_used(cluster.url)
    assert len(used) == 2 and all(value == 0 for value in used.values()), used


def test_a_burst_of_mixed_prompts_is_served_with_parity_and_no_leaks(cluster, client, offline, tiny_model):
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["x", PREFIX + "# more", "for i in range(10):\n    total += i\n" * 4, "class A:\n    pass\n"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda prompt: complete(client, tiny_model, prompt), prompts))
    for response in responses:
        assert_greedy_parity(offline, response)
    assert sum(decisions(cluster.url).values()) >= 3 + len(prompts)
    used = wait_no_kv_used(cluster.url)
    assert len(used) == 2 and all(value == 0 for value in used.values()), used
