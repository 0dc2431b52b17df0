"""Streams survive a decode engine's death (issue #49 item 3), as real processes: `pdserve up` with one prefill
and two decode engines, the real openai client streaming. SIGSTOP of a decode engine past the heartbeat timeout
(then SIGCONT), 10 s of SIGSTOP, and kill -9 of one: every stream completes with exactly the uninterrupted output
(greedy equal to the offline engine; seeded equal to its own uninterrupted run, logprobs too), usage counts every
token, the woken engine drops what moved instead of decoding it, no KV block stays used on an engine that is up,
and the router's /health answers within 1 s throughout."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve import SamplingParams
from tests.router.conftest import UpProcess, scrape, up_cluster, wait_no_kv_used

pytestmark = pytest.mark.hostile

PROMPTS = ["def main():", "import os\nimport sys\n\nclass Parser:", "x = [", "for i in range(10):\n    total +="]
MAX_TOKENS = 96  # with DEEP_LAYERS, 1-2 s of decoding: a stream is still going when its engine is struck
# for the 10 s stop: a stopped engine's streams are far from their end, so a woken engine that went on decoding
# them (rather than dropping them) would still be at it
LONG_MAX_TOKENS = 256
# The 2-layer tiny model decodes 384 tokens in about 0.5 s, so on a loaded host every stream could end before
# the test struck (CI saw no stream open on either decode engine); 16 layers make a step about 12 ms.
DEEP_LAYERS = 16
HEALTH_BOUND_S = 1.0  # issue #49: /health answers within 1 s through every fault


@pytest.fixture(scope="module")
def tiny_model(model_factory) -> str:
    """The tiny model, 16 layers deep (DEEP_LAYERS): the same shapes, steps slow enough to strike mid-stream."""
    return model_factory("llama", num_hidden_layers=DEEP_LAYERS)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    # --max-restarts 0: the killed engine stays dead (the survivor takes its streams); --heartbeat-timeout 1: the
    # stopped engine leaves routing after 1 s (the router's stall bound)
    yield from up_cluster(tiny_model, tmp_path_factory, "up-1p2d", "--num-prefill", "1", "--num-decode", "2",
                          "--max-restarts", "0", "--heartbeat-timeout", "1", "--migration-timeout", "20")


def migrations(cluster) -> float:
    return scrape(cluster.url).get("pdserve_router_migrations_total", {}).get((("outcome", "resumed"),), 0.0)


def busiest_decode_engine(cluster) -> str:
    """The decode engine the router has the most requests open on (the policy may put every stream on one), read
    until one has any (a loaded host may not have opened them yet when the first chunks came from the prefill)."""
    deadline = time.monotonic() + 10
    while True:
        inflight = scrape(cluster.url)["pdserve_engine_requests_in_flight"]
        counts = {dict(labels)["engine"]: value for labels, value in inflight.items()
                  if dict(labels)["role"] == "decode"}
        busiest = max(counts, key=counts.get)
        if counts[busiest] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert counts[busiest] > 0, counts
    return busiest


def wait_engines_free(url: str, num_engines: int, timeout: float = 60) -> dict:
    """/metrics' KV blocks used, read until `num_engines` engines report and none holds a block (or timeout)."""
    deadline = time.monotonic() + timeout
    used = wait_no_kv_used(url, timeout=timeout)
    while (len(used) != num_engines or any(used.values())) and time.monotonic() < deadline:
        time.sleep(0.2)
        used = wait_no_kv_used(url, timeout=max(0.0, deadline - time.monotonic()))
    return used


def orphans_aborted(cluster, name: str) -> int:
    """How many requests engine `name` has aborted because the link they came on was gone (its log)."""
    return (cluster.log_dir / f"{name}.log").read_text().count("aborted: the router that sent it is gone")


class HealthPoll(threading.Thread):
    """/health asked every 0.2 s on a thread of its own while the `with` block lasts, and once after: each
    answer's time and status (0: no answer)."""

    def __init__(self, url: str, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.url, self.interval_s = url, interval_s
        self.latencies: list[float] = []
        self.statuses: set[int] = set()
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stopped.is_set():
                self._ask(http)
                self.stopped.wait(self.interval_s)
            self._ask(http)  # and once after the fault

    def _ask(self, http: httpx.Client) -> None:
        start = time.monotonic()
        try:
            status = http.get(f"{self.url}/health").status_code
        except httpx.HTTPError:
            status = 0
        self.latencies.append(time.monotonic() - start)
        self.statuses.add(status)

    def __enter__(self) -> HealthPoll:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopped.set()
        self.join()

    def assert_answered(self) -> None:
        assert self.statuses == {200}, f"/health answered {self.statuses}: a decode engine was up throughout"
        assert max(self.latencies) <= HEALTH_BOUND_S, f"/health took {max(self.latencies):.2f}s"


class Streams:
    """Several streamed completions at once, each read on its own thread; `started` is released once per stream
    that has its second chunk (so every stream is mid-way when the test strikes)."""

    def __init__(self, client, model: str, requests: list[dict], max_tokens: int = MAX_TOKENS) -> None:
        self.started = threading.Semaphore(0)
        self.pool = ThreadPoolExecutor(len(requests))
        self.futures = [self.pool.submit(self._read, client, model, request, max_tokens) for request in requests]

    def _read(self, client, model: str, request: dict, max_tokens: int) -> dict:
        chunks = client.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                           max_tokens=max_tokens, **request)
        result = {"token_ids": [], "text": "", "logprobs": [], "finish_reason": None, "usage": None}
        for number, chunk in enumerate(chunks):
            if number == 1:
                self.started.release()
            if chunk.usage is not None:
                result["usage"] = chunk.usage
            for choice in chunk.choices:
                result["token_ids"] += choice.model_extra.get("token_ids") or []
                result["text"] += choice.text
                if choice.logprobs is not None:
                    result["logprobs"] += choice.logprobs.token_logprobs
                result["finish_reason"] = choice.finish_reason or result["finish_reason"]
        return result

    def wait_started(self) -> None:
        for _ in self.futures:
            assert self.started.acquire(timeout=120), "a stream did not start"

    def results(self) -> list[dict]:
        try:
            return [future.result(timeout=180) for future in self.futures]
        finally:
            self.pool.shutdown()


def greedy_requests() -> list[dict]:
    return [{"prompt": prompt, "temperature": 0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
            for prompt in PROMPTS]


@functools.cache
def offline_greedy(offline, prompt: str, max_tokens: int):
    """The offline engine's greedy completion of prompt (computed once per module run: the deep model is slow)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate(prompt, params)[0].outputs[0]


def assert_greedy(offline, results: list[dict], max_tokens: int = MAX_TOKENS) -> None:
    for prompt, result in zip(PROMPTS, results):
        expected = offline_greedy(offline, prompt, max_tokens)
        assert result["token_ids"] == expected.token_ids, "no token repeated, none missing"
        assert result["text"] == expected.text and result["finish_reason"] == "length"
        assert result["usage"].completion_tokens == max_tokens
        assert result["usage"].prompt_tokens == len(offline.tokenizer.encode(prompt))


def replayed_requests() -> list[dict]:
    """Requests compared with their own uninterrupted run: seeded sampling (logprobs, a penalty), and a
    structured output whose matcher must be taken over the tokens already streamed."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    constrained = {**extra, "structured_outputs": {"regex": "[a-z ]{4000}"}}  # longer than MAX_TOKENS: ends at length
    return [{"prompt": PROMPTS[0], "temperature": 1.0, "top_p": 0.9, "seed": 1234, "logprobs": 2, "extra_body": extra},
            {"prompt": PROMPTS[1], "temperature": 0.8, "seed": 7, "frequency_penalty": 0.5, "extra_body": extra},
            {"prompt": PROMPTS[2], "temperature": 0.7, "seed": 99, "extra_body": constrained}]


def test_a_stopped_decode_engine_hands_its_streams_over_and_its_late_tokens_go_nowhere(cluster, client, offline,
                                                                                        tiny_model):
    baseline = Streams(client, tiny_model, replayed_requests()).results()
    before = migrations(cluster)
    streams = Streams(client, tiny_model, greedy_requests() + replayed_requests())
    streams.wait_started()
    stopped = cluster.pid_of(busiest_decode_engine(cluster))
    os.kill(stopped, signal.SIGSTOP)
    try:
        results = streams.results()  # the stopped engine's streams go on on the other once it misses heartbeats
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert migrations(cluster) > before, "the stopped engine had streams mid-way"
    assert_greedy(offline, results[:len(PROMPTS)])
    for result, uninterrupted in zip(results[len(PROMPTS):], baseline):
        assert result["token_ids"] == uninterrupted["token_ids"], "a seed's sequence goes on across the migration"
        assert result["text"] == uninterrupted["text"] and result["usage"].completion_tokens == MAX_TOKENS
        assert result["logprobs"] == pytest.approx(uninterrupted["logprobs"], abs=1e-3)
    assert set(results[-1]["text"]) <= set("abcdefghijklmnopqrstuvwxyz "), "the constraint held across the move"
    used = wait_no_kv_used(cluster.url, timeout=60)  # the stopped engine is back, and dropped what it was decoding
    assert len(used) == 3 and all(value == 0 for value in used.values()), used


def test_a_decode_engine_stopped_for_10_s_loses_no_stream_and_drops_what_moved(cluster, client, offline, tiny_model):
    """Issue #49's case as written: SIGSTOP for 10 s during 8 greedy streams, then SIGCONT."""
    wait_no_kv_used(cluster.url, timeout=60)
    before = migrations(cluster)
    streams = Streams(client, tiny_model, greedy_requests() * 2, max_tokens=LONG_MAX_TOKENS)
    streams.wait_started()
    name = busiest_decode_engine(cluster)
    stopped = cluster.pid_of(name)
    aborted_before = orphans_aborted(cluster, name)
    with HealthPoll(cluster.url) as health:
        os.kill(stopped, signal.SIGSTOP)
        try:
            time.sleep(10)
        finally:
            os.kill(stopped, signal.SIGCONT)
        results = streams.results()
        used = wait_engines_free(cluster.url, num_engines=3)  # the woken engine back in routing, its blocks free
    health.assert_answered()
    moved = migrations(cluster) - before
    assert moved > 0, "the stopped engine had streams mid-way"
    assert_greedy(offline, results[:len(PROMPTS)], LONG_MAX_TOKENS)
    assert_greedy(offline, results[len(PROMPTS):], LONG_MAX_TOKENS)
    assert len(used) == 3 and all(value == 0 for value in used.values()), used
    # The woken engine aborts what moved and is still running (its log); a stream it had finished before the stop,
    # whose last tokens the router had not read yet, needs no abort, so the count is a bound, not an equality.
    aborted = orphans_aborted(cluster, name) - aborted_before
    assert aborted <= moved, f"the woken engine aborted {aborted} requests, more than the {moved:g} that moved"


def test_kill_9_of_a_decode_engine_loses_no_stream(cluster, client, offline, tiny_model):
    wait_no_kv_used(cluster.url, timeout=60)
    before = migrations(cluster)
    streams = Streams(client, tiny_model, greedy_requests() * 2)
    streams.wait_started()
    with HealthPoll(cluster.url) as health:  # through the kill, the moves and until every block is free
        os.kill(cluster.pid_of(busiest_decode_engine(cluster)), signal.SIGKILL)
        results = streams.results()
        used = wait_engines_free(cluster.url, num_engines=2)
    health.assert_answered()
    assert migrations(cluster) > before, "the killed engine had streams mid-way"
    assert_greedy(offline, results[:len(PROMPTS)])
    assert_greedy(offline, results[len(PROMPTS):])
    assert len(used) == 2 and all(value == 0 for value in used.values()), f"the surviving engines: {used}"


def test_streams_wait_for_their_restarted_engine_when_it_was_the_only_one(tiny_model, tmp_path, offline):
    """One decode engine, killed mid-stream: `pdserve up` restarts it, and its streams go on there (within
    --migration-timeout), each with exactly the uninterrupted tokens."""
    up = UpProcess(tiny_model, tmp_path, "--num-prefill", "0", "--num-decode", "1", "--heartbeat-timeout", "1",
                   "--migration-timeout", "60")
    try:
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)
        streams = Streams(client, tiny_model, greedy_requests())
        streams.wait_started()
        os.kill(up.pid_of("decode-0"), signal.SIGKILL)
        assert_greedy(offline, streams.results())
        assert migrations(up) >= 1
        used = wait_no_kv_used(up.url, timeout=60)
        assert len(used) == 1 and all(value == 0 for value in used.values()), used
    finally:
        assert up.stop() == 0, up.logs()
