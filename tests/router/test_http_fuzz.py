"""Fuzz the HTTP API with schemathesis, from the router's own /openapi.json, against a real cluster: a
`pdserve router` process with one prefill and one decode engine process on a tiny model.

Every operation gets valid bodies (they run on the engines) and invalid ones (they must be refused
with a 4xx). Asserted: no 5xx answer (nor a server error inside a streamed 200), the engine processes
are still the same live ones, the router's /health is green, and every KV block is free on both
engines afterwards. Bounded for CI (a few dozen examples per operation, derandomized so that a
failure reproduces); `pytest -m fuzz`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import start_together, stop_together
from tests.router.conftest import REPO, assert_openai_error, stop_process

pytestmark = pytest.mark.fuzz

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 40  # per operation and generation mode
# A short context keeps each valid request's generation short (max_tokens defaults to the rest of it).
ENGINE_ARGS = ("--block-size", "4", "--num-kv-blocks", "256", "--max-model-len", "48", "--max-num-batched-tokens", "64")


class RouterProcess:
    """`python -m pdserve router` given the engines' control addresses; waits for its PDSERVE_READY line."""

    def __init__(self, model_dir: str, prefill: EngineProcess, decode: EngineProcess, log_path) -> None:
        command = [sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--port", "0",
                   "--registration-address", "none", "--prefill-address", prefill.addresses["control"],
                   "--decode-address", decode.addresses["control"], "--insecure", "--api-key", API_KEY,
                   "--stats-interval", "0.2", "--log-level", "warning",
                   # what this test judges is the answer to hostile input, not liveness: an engine starved for 3 s by
                   # the other CI worker once left routing and its 503 read as a server error (the test still
                   # checks at the end that both engine processes are the ones it started)
                   "--heartbeat-timeout", "30"]
        self.log_path, self.log = log_path, open(log_path, "w")  # noqa: SIM115 (the process writes it until stop)
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        env={**os.environ, "PYTHONPATH": str(REPO)})
        line = self.process.stdout.readline()
        if not line.startswith("PDSERVE_READY role=router"):
            self.stop()
            raise RuntimeError(f"router did not start: {line!r}\n{log_path.read_text()[-3000:]}")
        self.url = dict(item.split("=", 1) for item in line.split()[1:])["url"]

    def stop(self) -> None:
        stop_process(self.process, timeout=30)
        self.log.close()


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fuzz-cluster")
    prefill, decode = start_together(lambda: EngineProcess("prefill", tiny_model, *ENGINE_ARGS, log_dir=log_dir),
                                     lambda: EngineProcess("decode", tiny_model, *ENGINE_ARGS, log_dir=log_dir))
    router = RouterProcess(tiny_model, prefill, decode, log_dir / "router.log")
    try:
        deadline = time.monotonic() + 30
        while health(router.url).json()["engines"] != {"prefill": 1, "decode": 1}:
            assert time.monotonic() < deadline, "the engines never became routable"
            time.sleep(0.1)
        yield router, prefill, decode
    finally:
        router.stop()
        stop_together(decode, prefill)


def server_errors_in_stream(body: str) -> list[dict]:
    """The server errors a streamed answer reported after its 200 status line (a 5xx in all but name)."""
    events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: {")]
    errors = [json.loads(event).get("error") for event in events]
    return [error for error in errors if isinstance(error, dict) and error.get("type") == "server_error"]


def fuzz_operation(operation, mode: GenerationMode, url: str) -> None:
    """MAX_EXAMPLES requests of one operation; hypothesis shrinks the first 5xx to a minimal case."""

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=url, headers=AUTH, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        assert not server_errors_in_stream(response.text), f"{case.as_curl_command()}\n{response.text[-2000:]}"

    run()


def has_input(operation) -> bool:
    return any(len(part) for part in (operation.body, operation.query, operation.path_parameters, operation.headers))


def test_fuzzed_requests_get_no_5xx_and_leave_the_cluster_whole(cluster):
    router, prefill, decode = cluster
    pids = {engine.role: engine.process.pid for engine in (prefill, decode)}
    schema = schemathesis.openapi.from_url(f"{router.url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = sorted(operation.label for operation in operations)
    assert "POST /v1/chat/completions" in labels and "POST /v1/completions" in labels, labels
    for operation in operations:
        fuzz_operation(operation, GenerationMode.POSITIVE, router.url)
        if has_input(operation):  # nothing to make invalid otherwise
            try:
                fuzz_operation(operation, GenerationMode.NEGATIVE, router.url)
            except Unsatisfiable:  # GET /v1/models/{model}: any string is a valid id, so no invalid request exists
                assert not len(operation.body) and not len(operation.query), operation.label

    for engine in (prefill, decode):
        assert engine.process.poll() is None, f"the {engine.role} engine died:\n{engine.log()[-3000:]}"
        assert engine.process.pid == pids[engine.role]
    assert health(router.url).status_code == 200, router.log_path.read_text()[-3000:]
    assert health(router.url).json()["engines"] == {"prefill": 1, "decode": 1}
    driver = Driver(decode, prefill)
    try:
        decode_stats, prefill_stats = driver.wait_idle(timeout_s=30)
    finally:
        driver.close()
    assert decode_stats.kv_blocks_used == 0 and prefill_stats.kv_blocks_used == 0, (decode_stats, prefill_stats)
    assert decode_stats.num_running == decode_stats.num_waiting == 0


# ---- what fuzzing the API turned up ----

def post_raw(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=body, timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_named_as_not_finite(cluster, literal):
    """Python's JSON parser takes these literals; they were refused as out of range ("must be >= 0" for NaN)."""
    router = cluster[0]
    response = post_raw(router.url, f'{{"prompt": "hi", "max_tokens": 1, "temperature": {literal}}}'.encode())
    error = assert_openai_error(response, 400, type_="invalid_request_error")
    assert "temperature" in error["message"] and "finite number" in error["message"], error
    assert error["param"] == "temperature"


def test_a_body_that_is_not_json_is_named_so(cluster):
    """It was "invalid request: 17: JSON decode error", with param "17" (a character offset, not a field)."""
    router = cluster[0]
    error = assert_openai_error(post_raw(router.url, b'{"prompt": "hi",,}'), 400, type_="invalid_request_error")
    assert error["message"].startswith("the request body is not valid JSON (") and "at character 16" in error["message"]
    assert error["param"] is None


@pytest.mark.parametrize("body, cause", [(b'{"prompt": "\xff"}', "UnicodeDecodeError"),
                                         (b'{"prompt": "hi", "n": ' + b"9" * 5000 + b"}", "ValueError"),
                                         (b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "RecursionError")],
                         ids=["not UTF-8", "an integer of 5000 digits", "nested 5000 deep"])
def test_a_body_that_cannot_be_parsed_says_why(cluster, body, cause):
    """It was "There was an error parsing the body", whatever the reason."""
    error = assert_openai_error(post_raw(cluster[0].url, body), 400, type_="invalid_request_error")
    assert error["message"].startswith(f"the request body could not be read as JSON ({cause}: "), error
