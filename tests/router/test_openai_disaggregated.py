"""`pdserve up --num-prefill 1 --num-decode 1` as real processes, driven through the real openai client:
output equals the offline engine token for token, streaming and not, stop strings, errors, client
disconnects free every KV block, a statically configured router reaches the same engines, and a
killed prefill engine leaves the service answering (the last test: it kills the engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve import SamplingParams
from pdserve.trust import default_cluster_keys
from tests.engine.test_llm_stops import first_new, token_texts
from tests.router.conftest import (
    REPO,
    assert_openai_error,
    chat_prompt_ids,
    scrape,
    up_cluster,
    wait_no_kv_used,
)

PROMPTS = ["def main():", "import os\nimport sys\n\nclass Parser:\n    def __init__(self, text):",
           "x", "for i in range(10):\n    total += i * i  # squares\n" * 3]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    # --max-restarts 0: the last test checks that a killed engine is routed around (test_supervision: restarts)
    yield from up_cluster(tiny_model, tmp_path_factory, "up-1p1d", "--num-prefill", "1", "--num-decode", "1",
                          "--max-restarts", "0")


def greedy(offline, prompt_token_ids, max_tokens=MAX_TOKENS):
    out = offline.generate({"prompt_token_ids": prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0]


def complete(client, model, prompt, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=extra.pop("max_tokens", MAX_TOKENS),
                                     temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
                                     **extra)


def test_greedy_completions_equal_the_offline_engine(cluster, client, offline, tiny_model):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all in flight at once
        responses = list(pool.map(lambda p: complete(client, tiny_model, p), PROMPTS))
    for prompt, response in zip(PROMPTS, responses):
        choice = response.choices[0]
        prompt_ids = choice.model_extra["prompt_token_ids"]
        assert prompt_ids == offline.tokenizer.encode(prompt)
        expected = greedy(offline, prompt_ids)
        assert choice.model_extra["token_ids"] == expected.token_ids
        assert choice.text == expected.text
        assert choice.finish_reason == "length"
        assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == MAX_TOKENS
    metrics = scrape(cluster.url)
    received = metrics["pdserve_kv_bytes_received_total"]
    assert sum(received.values()) > 0, "the decode engine got its prompts' KV from the prefill engine"
    assert sum(metrics["pdserve_kv_transfers_total"].values()) >= 1
    assert sum(metrics["pdserve_kv_transfer_seconds_total"].values()) > 0, "transfer latency is reported"
    queried = sum(metrics["pdserve_prefix_cache_queries_total"].values())
    assert queried >= 2 * sum(len(offline.tokenizer.encode(p)) for p in PROMPTS), "both engines look up every prompt"
    assert 0 <= sum(metrics["pdserve_prefix_cache_hits_total"].values()) <= queried
    used = wait_no_kv_used(cluster.url)
    assert len(used) == 2 and all(v == 0 for v in used.values()), used


def test_chat_streamed_and_whole_agree_with_the_offline_engine(client, offline, tiny_model):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list ✓"}]
    whole = client.chat.completions.create(model=tiny_model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = chat_prompt_ids(offline.tokenizer, messages)
    assert whole.model_extra["prompt_token_ids"] == prompt_ids
    expected = greedy(offline, prompt_ids)
    assert whole.choices[0].model_extra["token_ids"] == expected.token_ids
    assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"

    chunks = list(client.chat.completions.create(
        model=tiny_model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    # the same prompt again: the decode engine's prefix cache holds it now, which usage reports
    assert usage.prompt_tokens_details.cached_tokens > whole.usage.prompt_tokens_details.cached_tokens
    assert all(c.usage is None for c in chunks[:-1])


def _stop_for(text: str) -> tuple[str, str]:
    """A stop string whose first match is in the middle of `text`, and the text before it."""
    for start in range(len(text) // 3, len(text) - 2):
        stop = text[start:start + 2]
        if stop.strip() and "\ufffd" not in stop and text.index(stop) == start:
            return stop, text[:start]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_generation_and_free_the_engine(cluster, client, offline, tiny_model):
    prompt = PROMPTS[1]
    full = greedy(offline, offline.tokenizer.encode(prompt), max_tokens=40)
    stop, before = _stop_for(full.text)
    response = complete(client, tiny_model, prompt, max_tokens=40, stop=[stop, "\x00never"])
    choice = response.choices[0]
    assert choice.text == before and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert response.usage.completion_tokens < 40, "the decode engine was stopped early"

    streamed = "".join(c.choices[0].text for c in complete(client, tiny_model, prompt, max_tokens=40, stop=stop,
                                                           stream=True))
    assert streamed == before
    used = wait_no_kv_used(cluster.url)
    assert len(used) == 2 and all(v == 0 for v in used.values()), f"both engines report, none holds KV: {used}"


def test_stop_rules_equal_the_offline_engine(client, offline, tiny_model):
    """vLLM's stop rules through a prefill and a decode engine, streamed and whole, as offline: no stop string
    matches within min_tokens (here the prefill engine's first token), include_stop_str_in_output keeps it,
    and a stop token's text is left out."""
    prompt_ids = offline.tokenizer.encode(PROMPTS[1])
    full = greedy(offline, prompt_ids, max_tokens=8)
    texts = token_texts(offline.tokenizer, prompt_ids, full.token_ids)
    kept, stop_at = first_new(texts, 1), next(i for i in range(1, 8) if full.token_ids[i] not in full.token_ids[:i])
    cases = [({"stop": [texts[0]], "min_tokens": 1}, None),
             ({"stop": [texts[kept]], "include_stop_str_in_output": True}, "".join(texts[:kept + 1])),
             ({"stop_token_ids": [full.token_ids[stop_at]]}, "".join(texts[:stop_at]))]
    for fields, text in cases:
        want = offline.generate({"prompt_token_ids": prompt_ids}, SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, **fields))[0].outputs[0]
        assert want.text == (text or want.text) and len(want.token_ids) > fields.get("min_tokens", 0), fields
        body = {"return_token_ids": True, "ignore_eos": True, **fields}
        stop = body.pop("stop", None)
        whole = client.completions.create(model=tiny_model, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                          stop=stop, extra_body=body).choices[0]
        assert (whole.text, whole.model_extra["token_ids"], whole.finish_reason) == (
            want.text, want.token_ids, want.finish_reason), fields
        chunks = list(client.completions.create(model=tiny_model, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                                stop=stop, extra_body=body, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want.text, fields


def test_logit_bias_steers_the_prefill_and_the_decode_engine_alike(client, offline, tiny_model):
    """+100 all but forces a token and -100 bans one, in the first token (the prefill engine's) and every
    later one (the decode engine's), as the offline engine does with the same bias."""
    prompt = PROMPTS[0]
    ids = offline.tokenizer.encode(prompt)
    unbiased = greedy(offline, ids, max_tokens=4).token_ids
    wants = []
    for bias in ({unbiased[0]: -100.0}, {7: 100.0}):
        wants.append(offline.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias=bias))[0].outputs[0].token_ids)
        got = complete(client, tiny_model, prompt, max_tokens=4, logit_bias={str(k): v for k, v in bias.items()})
        assert got.choices[0].model_extra["token_ids"] == wants[-1], bias
    banned, forced = wants
    assert banned[0] != unbiased[0] and forced == [7] * 4 and unbiased[0] != 7


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 100}, 400),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": [5, 99999], "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "word " * 600}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("/v1/nothing-here", {}, 404),
])
def test_bad_requests_get_openai_errors(cluster, path, body, status):
    response = httpx.post(f"{cluster.url}{path}", json=body, timeout=30)
    assert_openai_error(response, status)


def test_malformed_json_is_400_and_the_client_maps_it(cluster, client, tiny_model):
    response = httpx.post(f"{cluster.url}/v1/completions", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400, type_="invalid_request_error")
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=tiny_model, prompt="word " * 600)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


def test_client_disconnecting_mid_stream_frees_every_kv_block(cluster, tiny_model):
    body = {"model": tiny_model, "prompt": PROMPTS[3], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: _read_then_leave(cluster.url, body), range(3)))
    used = wait_no_kv_used(cluster.url)
    assert used and all(value == 0 for value in used.values()), f"KV blocks still used: {used}"
    scraped = scrape(cluster.url)
    assert all(v == 0 for v in scraped["pdserve_engine_requests_in_flight"].values())
    assert all(v == 0 for v in scraped["pdserve_num_requests_running"].values())
    assert scraped["pdserve_requests_total"][(("endpoint", "/v1/completions"), ("status", "499"))] >= 3


def _read_then_leave(url: str, body: dict) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        num_chunks = sum(1 for _, line in zip(range(8), lines) if line.startswith("data: "))
        assert num_chunks >= 3
    # leaving the block closes the connection with the generation far from done


def test_a_router_given_static_addresses_reaches_the_same_engines(cluster, client, offline, tiny_model):
    prefill, decode = cluster.ready_line("prefill-0"), cluster.ready_line("decode-0")
    command = [sys.executable, "-m", "pdserve", "router", "--model", tiny_model, "--port", "0",
               "--registration-address", "none", "--prefill-address", prefill["control"],
               "--decode-address", decode["control"],
               "--curve-dir", str(default_cluster_keys())]  # the keys `pdserve up` made for the cluster
    router = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = router.stdout.readline()
        assert line.startswith("PDSERVE_READY role=router"), line
        url = dict(item.split("=", 1) for item in line.split()[1:])["url"]
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["engines"] != {"prefill": 1, "decode": 1}:
            assert time.monotonic() < deadline, "static engines never became routable"
            time.sleep(0.1)
        static = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        choice = complete(static, tiny_model, PROMPTS[0]).choices[0]
        assert choice.model_extra["token_ids"] == greedy(offline, offline.tokenizer.encode(PROMPTS[0])).token_ids
        engines = scrape(url)["pdserve_kv_bytes_received_total"]
        assert engines[(("engine", "decode-0"), ("role", "decode"))] > 0
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=30)
        router.stdout.close()


def test_killing_the_prefill_engine_leaves_the_service_answering(cluster, client, offline, tiny_model):
    os.kill(cluster.pid_of("prefill-0"), signal.SIGKILL)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    with ThreadPoolExecutor(len(prompts)) as pool:  # sent at once, before the router notices
        responses = list(pool.map(lambda p: complete(client, tiny_model, p), prompts))
    for prompt, response in zip(prompts, responses):
        expected = greedy(offline, offline.tokenizer.encode(prompt))
        assert response.choices[0].model_extra["token_ids"] == expected.token_ids
    deadline = time.monotonic() + 15
    while httpx.get(f"{cluster.url}/health").json()["engines"]["prefill"] != 0:
        assert time.monotonic() < deadline, "the dead prefill engine stayed in routing"
        time.sleep(0.2)
    assert complete(client, tiny_model, PROMPTS[2]).choices[0].finish_reason == "length"
    used = wait_no_kv_used(cluster.url)
    assert used == {(("engine", "decode-0"), ("role", "decode")): 0.0}
