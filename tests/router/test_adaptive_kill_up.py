"""kill -9 of a dual-role engine mid-stream (issue #47), as real processes: `pdserve up --num-engines 2 --adaptive`,
the real openai client, streams decoded on the victim and prompts it was prefilling for the other engine when it
died. Every stream completes with the offline engine's greedy tokens or ends with the in-band error; the survivor
holds no KV block afterwards; the router stays healthy and serves a new request.

How the paths are forced: the step profile makes prompt tokens dear, decode steps grow with the batch and its
context and the KV link free, and the SLOs are loose, so the adaptive policy chooses by harm alone. Five streams
started one at a time alternate between the idle engines (each colocated on the engine decoding less); the one
decoding three is the victim. Then both engines are stopped (SIGSTOP, well within the heartbeat timeout) so that
the router's ledger (/metrics' requests in flight per engine) holds still, and three prompts follow whose prefixes
only the victim has cached: at least one is prefilled on the victim and decoded on the other engine, which decodes
fewer. The victim is killed (SIGKILL, while stopped: the prompts it was prefilling are certainly unfinished) and
the other engine continued (SIGCONT). The router's log shows the prefill engine lost and the prompt computed
again; /metrics counts a migration (resumed, or failed in-band) for each stream the victim decoded."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.router.conftest import openai_client, scrape, up_cluster, wait_no_kv_used
from tests.router.test_migration_up import DEEP_LAYERS

pytestmark = pytest.mark.hostile

PROFILE = {
    "model": {"kv_bytes_per_token": 1},
    "engine": {"max_num_batched_tokens": 64},
    "prefill_fit": {"coefficients": {"intercept": 0.0, "tokens": 0.05, "attention": 0.0}},
    "decode_fit": {"coefficients": {"intercept": 0.01, "batch": 0.05, "context": 0.0001}},
    "transfer_fit": {"coefficients": {"intercept": 0.0, "bytes": 0.0}},
}
# five prompts that differ from their first token: no two share a cached block
PREFIXES = ["import json\nimport sys\n\ndef load(path):\n    with open(path) as f:\n",
            "class Stack:\n    def __init__(self):\n        self.items = []\n",
            "for row in table:\n    if row.total > limit:\n        print(row.name)\n",
            "SELECT name, count(*) FROM orders WHERE price > 10 GROUP BY name\n",
            "# Notes on the release\n\nThe parser now accepts nested lists.\n"]
STREAM_TOKENS = 400  # the first streams: still decoding when the test strikes (about 100 tokens in)
LATE_TOKENS = 24  # the prompts sent while the engines are stopped


@pytest.fixture(scope="module")
def tiny_model(model_factory) -> str:
    """The tiny model, 16 layers deep: the same shapes, steps slow enough that every stream is still decoding when
    the test strikes (with 2 layers a stream could finish first on a busy host)."""
    return model_factory("llama", num_hidden_layers=DEEP_LAYERS)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    profile = tmp_path_factory.mktemp("kill-profile") / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    # --max-restarts 0: the victim stays dead; more KV blocks: the survivor takes every stream without preempting;
    # --heartbeat-timeout 15: stopped engines stay in routing while the test sends them prompts (the victim's death
    # is seen at once, by the router's link monitor)
    yield from up_cluster(tiny_model, tmp_path_factory, "up-adaptive-kill", "--num-engines", "2", "--adaptive",
                          "--slo", "ttft:1000000", "tpot:1000000", "--step-profile", str(profile),
                          "--max-restarts", "0", "--num-kv-blocks", "2048", "--heartbeat-timeout", "15",
                          "--migration-timeout", "30")


class Stream(threading.Thread):
    """One streamed greedy completion read on its own thread: its token ids, finish reason, or in-band error."""

    def __init__(self, client, model: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.prompt, self.max_tokens = client, model, prompt, max_tokens
        self.first_chunk = threading.Event()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            chunks = self.client.completions.create(model=self.model, prompt=self.prompt, max_tokens=self.max_tokens,
                                                    temperature=0, stream=True,
                                                    extra_body={"return_token_ids": True, "ignore_eos": True})
            for chunk in chunks:
                self.first_chunk.set()
                for choice in chunk.choices:
                    self.token_ids += choice.model_extra.get("token_ids") or []
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except openai.APIError as exc:  # the in-band error: `data: {"error": ...}` in the stream
            self.error = str(exc)
        finally:
            self.first_chunk.set()


def in_flight(url: str) -> dict[str, float]:
    samples = scrape(url)["pdserve_engine_requests_in_flight"]
    return {dict(labels)["engine"]: value for labels, value in samples.items()}


def wait_routed(url: str, before: dict[str, float], timeout: float = 5.0) -> tuple[dict[str, float], dict]:
    """(the requests the router opened per engine since `before`, the counts now), once it has routed one more
    request (it opens a request on its prefill and its decode engine at once)."""
    deadline = time.monotonic() + timeout
    while True:
        now = in_flight(url)
        opened = {engine: value - before[engine] for engine, value in now.items()}
        if any(value > 0 for value in opened.values()):
            return opened, now
        assert time.monotonic() < deadline, "the router did not route the request in time"
        time.sleep(0.01)


def greedy(offline, streams: list[Stream]) -> list[list[int]]:
    """The offline engine's greedy tokens for each stream's prompt and length, in one batch."""
    from pdserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=stream.max_tokens, ignore_eos=True) for stream in streams]
    return [output.outputs[0].token_ids for output in offline.generate([stream.prompt for stream in streams], params)]


def test_kill_9_of_a_dual_engine_mid_stream(cluster, offline, tiny_model):
    client = openai_client(cluster)
    streams, decoded_on = [], []
    for prefix in PREFIXES:  # one at a time, each routed on the ledger as the ones before left it
        before = in_flight(cluster.url)
        streams.append(Stream(client, tiny_model, prefix + "# go", STREAM_TOKENS))
        assert streams[-1].first_chunk.wait(120) and streams[-1].error is None, streams[-1].error
        opened, _ = wait_routed(cluster.url, before)  # its first token came: open on its decode engine only
        decoded_on.append(max(opened, key=opened.get))
    victim = max(set(decoded_on), key=decoded_on.count)  # each stream went to the engine that decoded less
    survivor = next(engine for engine in decoded_on if engine != victim)
    assert sorted(decoded_on.count(engine) for engine in (victim, survivor)) == [2, 3], decoded_on
    pids = {engine: cluster.pid_of(engine) for engine in (victim, survivor)}

    for pid in pids.values():  # both frozen mid-stream: the ledger holds still while the late prompts are routed
        os.kill(pid, signal.SIGSTOP)
    try:
        counts = in_flight(cluster.url)  # each scrape waits 0.5 s for the stopped engines
        assert counts == {victim: 3, survivor: 2}, f"every stream is mid-way: {counts}"
        late, paths = [], []
        # prompts cached on the victim only: its streams' prefixes
        for prefix in (prefix for prefix, engine in zip(PREFIXES, decoded_on) if engine == victim):
            late.append(Stream(client, tiny_model, prefix + "# again", LATE_TOKENS))
            opened, counts = wait_routed(cluster.url, counts)
            paths.append(opened)
    finally:
        os.kill(pids[victim], signal.SIGKILL)
        os.kill(pids[survivor], signal.SIGCONT)
    assert {victim: 1, survivor: 1} in paths, f"a prompt routed between the two engines: {paths}"

    for stream in streams + late:
        stream.join(timeout=180)
        assert not stream.is_alive(), "a stream hung after its engine was killed"
    for stream, expected in zip(streams + late, greedy(offline, streams + late)):
        if stream.error is None:
            assert stream.token_ids == expected and stream.finish_reason == "length"
        else:
            assert "the request failed" in stream.error, stream.error
    assert all(stream.error is None for stream, engine in zip(streams, decoded_on) if engine == survivor), \
        "the survivor's own streams go on"
    migrated = scrape(cluster.url).get("pdserve_router_migrations_total", {})
    assert sum(migrated.values()) == 3, f"each stream the victim decoded moved, or failed in-band: {migrated}"
    router_log = (cluster.log_dir / "router.log").read_text()
    assert f"prefill engine {victim} left" in router_log, "a prompt the victim was prefilling was computed again"

    health = httpx.get(f"{cluster.url}/health", timeout=10)
    assert health.status_code == 200, health.text
    survivor_only = {(("engine", survivor), ("role", "dual")): 0}
    assert wait_no_kv_used(cluster.url, timeout=60) == survivor_only, "the survivor alone, holding no KV block"
    assert in_flight(cluster.url) == {survivor: 0}, "the router holds no request open"
    after = Stream(client, tiny_model, PREFIXES[1] + "# after", LATE_TOKENS)
    after.join(timeout=120)
    assert after.error is None and after.token_ids == greedy(offline, [after])[0]
    assert wait_no_kv_used(cluster.url, timeout=60) == survivor_only
