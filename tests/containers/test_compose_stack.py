"""compose.cpu.yaml run for real: the image built from the Dockerfile, the stack started with podman-compose,
traffic through the published router port with the `openai` client, scaling, a killed engine, a clean stop.

Slow (an image build and a stack start): marked `containers`, run by deploy/container_smoke.sh, which installs
podman, podman-compose and an offline base image first. Skipped with the reason when no container engine runs.
Environment: PDSERVE_BASE_IMAGE (the Dockerfile's BASE_IMAGE), PDSERVE_TORCH_INDEX_URL (where torch comes from),
PDSERVE_CONTAINER_REPORT (a JSON file to write the measured build and start times to).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.containers.stack import ComposeStack, free_port, missing_tools, podman
from tests.router.conftest import REPO, chat_prompt_ids, scrape

pytestmark = [pytest.mark.containers, pytest.mark.timeout(2400)]

PROJECT = "pdserve-cpu-test"
MODEL = "pdserve-demo"
DOCUMENTED_VOLUMES = {f"{PROJECT}_{name}" for name in ("hf-cache", "demo-model", "cluster-keys")}
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def push(self, item):"]
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list"}]
MAX_TOKENS = 12
APP_USER_ID = 10001  # the Dockerfile's pdserve user
REPORT: dict[str, float | str] = {}


@pytest.fixture(scope="module")
def stack():
    problem = missing_tools()
    if problem:
        pytest.skip(problem)
    env = {"PDSERVE_PORT": str(free_port())}
    for name in ("PDSERVE_BASE_IMAGE", "PDSERVE_TORCH_INDEX_URL"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    compose = ComposeStack(REPO, "compose.cpu.yaml", PROJECT, env)
    compose.remove_everything()  # a stack left by an interrupted run
    try:
        started = time.monotonic()
        compose.compose("build", timeout=1800)
        REPORT["build_s"] = time.monotonic() - started
        started = time.monotonic()
        compose.compose("up", "-d", timeout=900)
        compose.wait_healthy(timeout=600)
        REPORT["first_up_s"] = time.monotonic() - started
        yield compose
    finally:
        compose.remove_everything()
        if os.environ.get("PDSERVE_CONTAINER_REPORT"):
            with open(os.environ["PDSERVE_CONTAINER_REPORT"], "w") as out:
                json.dump(REPORT, out, indent=1)


@pytest.fixture(scope="module")
def url(stack):
    return f"http://127.0.0.1:{stack.env['PDSERVE_PORT']}"


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(stack):
    """The offline engine on this host, on the very model directory the containers serve."""
    from pdserve import LLM

    return LLM(str(stack.volume_path("demo-model") / MODEL), dtype="float32")


def greedy(offline, prompt_ids):
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return offline.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]


def engines_up(url: str, role: str) -> dict[str, float]:
    """{engine id: 1.0 in routing / 0.0 not} from the router's /metrics."""
    return {dict(labels)["engine"]: value for labels, value in scrape(url).get("pdserve_engine_up", {}).items()
            if dict(labels)["role"] == role}


def looked_up(url: str, role: str) -> dict[str, float]:
    """{engine id: prompt tokens it looked up in its prefix cache}: every request an engine admits counts."""
    queries = scrape(url).get("pdserve_prefix_cache_queries_total", {})
    return {dict(labels)["engine"]: value for labels, value in queries.items() if dict(labels)["role"] == role}


def two_nonzero(values: dict[str, float]) -> dict[str, float] | None:
    return values if len(values) == 2 and all(values.values()) else None


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s")


def key_digests(stack) -> dict[str, str]:
    keys = stack.volume_path("cluster-keys")
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(keys.iterdir())}


def test_stack_runs_non_root_and_publishes_only_the_http_port(stack, url):
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    for service in ("router", "prefill", "decode"):
        (name,) = stack.names(service)
        assert podman("exec", name, "id", "-u").stdout.strip() == str(APP_USER_ID), f"{service} runs as root"
        published = {port: bindings for port, bindings in (stack.inspect(name)["NetworkSettings"]["Ports"] or {}).items()
                     if bindings}
        assert set(published) == ({"8000/tcp"} if service == "router" else set()), (service, published)
        # on loopback only, as PDSERVE_PUBLISH_IP defaults: this stack has no API key
        assert all(binding["HostIp"] == "127.0.0.1" for bindings in published.values() for binding in bindings)
    (router,) = stack.names("router")
    logs = podman("logs", router)
    assert "no API key and HTTP on 0.0.0.0" in logs.stdout + logs.stderr
    (decode,) = stack.names("decode")
    # the engine is PID 1 (the entrypoint execs it); the compose file leaves OMP_NUM_THREADS empty
    environ = podman("exec", decode, "sh", "-c", "tr '\\0' '\\n' < /proc/1/environ; nproc").stdout.split()
    assert f"OMP_NUM_THREADS={environ[-1]}" in environ, "OMP_NUM_THREADS follows the container's cores"


def test_keys_are_private_to_the_app_user_and_every_plane_needs_them(stack):
    keys = stack.volume_path("cluster-keys")
    assert {p.name for p in keys.iterdir()} == {"server.key", "client.key"}
    for path in keys.iterdir():
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == APP_USER_ID, path
    (router,) = stack.names("router")
    probe = ["exec", router, "python", "-m", "pdserve.router.probe", "--timeout", "2"]
    for target in ("tcp://decode:5600", "tcp://prefill:5600", "tcp://prefill:5700"):
        assert podman(*probe, target, check=False).returncode != 0, f"{target} answers a client without keys"
    for target in ("tcp://decode:5600", "tcp://prefill:5600"):
        assert podman(*probe, target, "--curve-dir", "/keys", check=False).returncode == 0, target


def test_greedy_completions_through_the_published_port_equal_the_offline_engine(client, offline):
    def complete(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(complete, PROMPTS))
    for prompt, response in zip(PROMPTS, responses):
        choice = response.choices[0]
        prompt_ids = offline.tokenizer.encode(prompt)
        assert choice.model_extra["prompt_token_ids"] == prompt_ids
        expected = greedy(offline, prompt_ids)
        assert choice.model_extra["token_ids"] == expected.token_ids and choice.text == expected.text
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == responses[0].choices[0].text


def test_greedy_chat_streamed_and_whole_equal_the_offline_engine(client, offline, url):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = chat_prompt_ids(offline.tokenizer, MESSAGES)
    assert whole.model_extra["prompt_token_ids"] == prompt_ids
    expected = greedy(offline, prompt_ids)
    assert whole.choices[0].message.content == expected.text
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    received = scrape(url)["pdserve_kv_bytes_received_total"]
    assert sum(received.values()) > 0, "the decode container got prompt KV from the prefill container"


def test_scaled_decode_replicas_both_serve_and_keys_and_model_are_made_once(stack, client, url):
    digests = key_digests(stack)
    weights = stack.volume_path("demo-model") / MODEL / "model.safetensors"
    weights_mtime = weights.stat().st_mtime_ns
    stack.compose("up", "-d", "--scale", "decode=2", timeout=900)
    stack.wait_healthy(timeout=600)
    assert len(stack.names("decode")) == 2
    up = wait_for(lambda: two_nonzero(engines_up(url, "decode")), 120, "two decode engines registered with the router")
    assert all(engine.startswith("decode-") for engine in up), up  # ids from the containers' host names
    with ThreadPoolExecutor(8) as pool:  # all in flight at once: least_kv spreads them by in-flight count
        list(pool.map(lambda i: client.completions.create(model=MODEL, prompt=f"{PROMPTS[1]}x{i} = ", max_tokens=8,
                                                          temperature=0), range(8)))
    wait_for(lambda: two_nonzero(looked_up(url, "decode")), 30,
             f"both decode engines served requests: {looked_up(url, 'decode')}")
    assert key_digests(stack) == digests, "a second `up` kept the cluster's keys"
    assert weights.stat().st_mtime_ns == weights_mtime, "a second `up` kept the demo model"


def test_a_killed_decode_container_leaves_routing_and_comes_back(stack, client, url):
    victim = stack.names("decode")[0]
    victim_engine = f"decode-{stack.inspect(victim)['Config']['Hostname']}"
    os.kill(stack.inspect(victim)["State"]["Pid"], signal.SIGKILL)  # as the kernel's OOM killer would
    wait_for(lambda: engines_up(url, "decode").get(victim_engine, 0.0) == 0.0, 30,
             f"the router took {victim_engine} out of routing")
    for index in range(4):  # meanwhile the other replica answers
        response = client.completions.create(model=MODEL, prompt=f"{PROMPTS[0]} # {index}", max_tokens=4,
                                             temperature=0)
        assert response.choices[0].finish_reason == "length"
    # Docker applies the restart policy. podman 4.3 does not restart a container created with --requires
    # (podman-compose's depends_on) once the one-shot services it requires have exited: `up -d` starts it.
    time.sleep(10)
    REPORT["killed_decode_back_by"] = "restart policy"
    if stack.inspect(victim)["State"]["Status"] != "running":
        assert stack.inspect(victim)["State"]["ExitCode"] == 137
        stack.compose("up", "-d", "--scale", "decode=2", timeout=900)
        REPORT["killed_decode_back_by"] = "up -d"
    wait_for(lambda: stack.inspect(victim)["State"]["Status"] == "running", 120, f"{victim} running again")
    stack.wait_healthy(timeout=300)
    wait_for(lambda: engines_up(url, "decode").get(victim_engine) == 1.0, 120, f"{victim_engine} back in routing")
    response = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason == "length"


def test_down_leaves_only_the_documented_volumes(stack):
    # podman-compose knows only the unscaled containers: --remove-orphans takes the extra replica too. Its
    # first pass removes the replica last, and podman refuses to remove a container a replica still requires.
    for _ in range(2):
        stack.compose("down", "--remove-orphans", "-t", "20", timeout=300)
        if not stack.containers():
            break
    assert stack.containers() == []
    assert stack.networks() == set()
    assert stack.volumes() == DOCUMENTED_VOLUMES, "compose keeps named volumes (keys, model, hub cache) on down"
    stack.compose("down", "-v", timeout=300)
    assert stack.volumes() == set(), "`down -v` removes them"
