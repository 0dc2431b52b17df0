"""Router test helpers: an in-process router (the real app, real ZeroMQ, fake engines) and
`pdserve up` as a real subprocess with the real openai client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 180
# Small blocks so prompts span several; float32 so HTTP output equals the offline engine's.
ENGINE_ARGS = ("--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "512", "--max-num-batched-tokens", "64")


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture(scope="session")
def tokenization(tiny_model):
    from pdserve.router.tokenization import Tokenization

    return Tokenization(tiny_model)


# ---- the router in this process ----

@contextlib.asynccontextmanager
async def started_router(model_dir: str, tokenization, **overrides):
    """(gateway, app) of a started router in this event loop; engines register at
    gateway.registry.registration_address."""
    from pdserve.router.api import create_app
    from pdserve.router.config import RouterConfig
    from pdserve.router.gateway import Gateway

    settings = {"registration_address": "tcp://127.0.0.1:0", "heartbeat_timeout_s": 0.6, "stats_interval_s": 0.2,
                "request_timeout_s": 30.0, **overrides}
    config = RouterConfig(model=model_dir, served_model_name="tiny", **settings)
    gateway = Gateway(config, tokenization)
    app = create_app(config, gateway)
    await gateway.start()
    try:
        yield gateway, app
    finally:
        await gateway.close()


@contextlib.asynccontextmanager
async def router_app(model_dir: str, tokenization, **overrides):
    """(gateway, httpx client) for a router app served in this event loop."""
    async with started_router(model_dir, tokenization, **overrides) as (gateway, app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router", timeout=30) as client:
        yield gateway, client


@contextlib.asynccontextmanager
async def router_server(model_dir: str, tokenization, **overrides):
    """(gateway, base url) for a router app behind a real uvicorn server in this event loop, for
    what needs real sockets (a client that hangs up)."""
    import uvicorn

    from pdserve.router.header_deadline import HeaderDeadlineProtocol
    from pdserve.router.server import bind_http

    async with started_router(model_dir, tokenization, **overrides) as (gateway, app):
        sock = bind_http("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=1,
                                               http=HeaderDeadlineProtocol))  # as router/server.py serves
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        await wait_until(lambda: server.started, what="uvicorn started")
        try:
            yield gateway, f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            await serving
            sock.close()


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.02)


async def health_latencies(client: httpx.AsyncClient, busy: asyncio.Future, interval: float = 0.05) -> list[float]:
    """/health latencies (s) measured from a concurrent client while `busy` runs; each answer must be 200."""
    latencies = []
    while not busy.done():
        start = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(interval)
    return latencies


def assert_openai_error(response: httpx.Response, status: int, *, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if type_ is not None:
        assert error["type"] == type_
    return error


# ---- `pdserve up` as a subprocess ----

class UpProcess:
    """`python -m pdserve up ...`; waits for its PDSERVE_READY role=up line."""

    def __init__(self, model_dir: str, log_dir: Path, *args: str, env: dict | None = None) -> None:
        self.log_dir = log_dir
        command = [sys.executable, "-m", "pdserve", "up", "--model", model_dir, "--port", "0",
                   "--log-dir", str(log_dir), "--log-level", "warning", *ENGINE_ARGS, *args]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
        self.lines: list[str] = []
        self.url = self._wait_ready()["url"]

    def _wait_ready(self) -> dict[str, str]:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 1.0)
            if ready:
                line = self.process.stdout.readline()
                self.lines.append(line)
                if line.startswith("PDSERVE_READY role=up"):
                    return dict(item.split("=", 1) for item in line.split()[1:])
            if self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError("pdserve up did not become ready:\n" + "".join(self.lines) + self.logs())

    def pid_of(self, name: str) -> int:
        line = next(line for line in self.lines if line.startswith(f"[pdserve up] {name} ready"))
        return int(line.split(" pid ")[1].split(",")[0])

    def ready_line(self, name: str) -> dict[str, str]:
        """The PDSERVE_READY fields a component printed in its log."""
        for line in (self.log_dir / f"{name}.log").read_text().splitlines():
            if line.startswith("PDSERVE_READY"):
                return dict(item.split("=", 1) for item in line.split()[1:])
        raise KeyError(name)

    def logs(self) -> str:
        return "".join(f"\n--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> int:
        return stop_process(self.process, timeout=40)


def stop_process(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL after `timeout` s; closes its stdout pipe; returns its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()
    return process.returncode


def up_cluster(model_dir: str, tmp_path_factory, name: str, *args: str, env: dict | None = None):
    """For a module-scoped fixture (`yield from`): `pdserve up *args` logging under a fresh tmp dir `name`;
    it must stop cleanly."""
    up = UpProcess(model_dir, tmp_path_factory.mktemp(name), *args, env=env)
    yield up
    assert up.stop() == 0, up.logs()


def layout_cluster(request, model_dir: str, tmp_path_factory, name: str, *args: str):
    """For a fixture parametrized over the layouts (`yield from`): layout_stack(request.param, *args)."""
    with layout_stack(request.param, model_dir, tmp_path_factory.mktemp(f"up-{name}-{request.param}"), *args) as up:
        yield up


def scrape(url: str, api_key: str | None = None) -> dict[str, dict[tuple, float]]:
    """/metrics as {metric name: {label values: value}} (counters under their sample name)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    metrics: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            metrics.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return metrics


def kv_blocks_used(url: str, api_key: str | None = None) -> dict[tuple, float]:
    return scrape(url, api_key).get("pdserve_kv_blocks_used", {})


def wait_no_kv_used(url: str, timeout: float = 20.0, api_key: str | None = None) -> dict[tuple, float]:
    """Poll /metrics until no engine holds a KV block; returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        used = kv_blocks_used(url, api_key)
        if used and all(value == 0 for value in used.values()):
            return used
        if time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def start_layout(layout: str, model_dir: str, log_dir: Path, *args: str) -> UpProcess:
    """`pdserve up` served as "tiny" in one of the two layouts the end-to-end API tests run in: "1p1d"
    (disaggregated) or "colocated" (no prefill engine); `args`: more `pdserve up` flags."""
    num_prefill = "1" if layout == "1p1d" else "0"
    up = UpProcess(model_dir, log_dir, "--num-prefill", num_prefill, "--num-decode", "1", "--served-model-name", "tiny",
                   *args)
    up.layout = layout
    return up


def assert_no_kv_used(up: UpProcess) -> None:
    used = wait_no_kv_used(up.url)
    assert used and all(value == 0 for value in used.values()), used


@contextlib.contextmanager
def layout_stack(layout: str, model_dir: str, log_dir: Path, *args: str):
    """start_layout(layout, ..., *args) for the block. On exit: no KV block held, and a clean stop."""
    up = start_layout(layout, model_dir, log_dir, *args)
    yield up
    assert_no_kv_used(up)
    assert up.stop() == 0, up.logs()


@pytest.fixture(scope="session")
def shared_layouts():
    """The `pdserve up` of each layout (start_layout, no flag of a module's own) that shared_layout_cluster started,
    by (layout, model dir): started by the first module that asks, served to every later one (each start is a router
    and its engines: seconds); each stops cleanly at the session's end."""
    started: dict[tuple[str, str], UpProcess] = {}
    yield started
    for up in started.values():
        assert up.stop() == 0, up.logs()


def shared_layout_cluster(layout: str, model_dir: str, tmp_path_factory, shared_layouts: dict):
    """For a module-scoped fixture (`yield from`): start_layout(layout) as the session's modules share it
    (shared_layouts), for a module whose tests need nothing of a fresh one; the module ends with no KV block held."""
    key = (layout, model_dir)
    if key not in shared_layouts:
        shared_layouts[key] = start_layout(layout, model_dir, tmp_path_factory.mktemp(f"up-shared-{layout}"))
    yield shared_layouts[key]
    assert_no_kv_used(shared_layouts[key])


def openai_client(up: UpProcess, timeout: float = 120, api_key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=f"{up.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def client(cluster):
    """The openai client of the module's `cluster` fixture."""
    return openai_client(cluster)


@pytest.fixture(scope="module")
def offline(tiny_model):
    """The offline engine with `pdserve up`'s ENGINE_ARGS, the reference for token-for-token parity."""
    from pdserve import LLM

    return LLM(tiny_model, dtype="float32", block_size=4, num_kv_blocks=512)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt token ids of a chat as the router renders it: the chat template with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_refused(responses: list[httpx.Response], param: str, words: list[str]) -> None:
    """Each response is a 400 invalid_request_error naming `param`, its message holding every word."""
    for response in responses:
        error = assert_openai_error(response, 400, type_="invalid_request_error")
        assert error["param"] == param, error
        for word in words:
            assert word in error["message"], error
