"""Hostile structured-output requests against a real `pdserve up` (issue 49): every payload class over its
bound, through each field that carries a constraint, is a 400 naming the field and the limit; 20 requests
of the classes that crashed the router (a segfault in the grammar compiler) within a minute leave the same
router process answering, /health fast, and a log line naming each sender before its check, never the
payload itself."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.hostile_grammars import CLASSES, lark_rule_chain, schema_defs_chain, schema_ref_chain
from tests.router.conftest import assert_openai_error, layout_stack

pytestmark = pytest.mark.hostile

HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def up(tiny_model, tmp_path_factory):
    with layout_stack("colocated", tiny_model, tmp_path_factory.mktemp("up-hostile"), "--log-level", "info") as up:
        yield up


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 8, **fields}


def named_tool(schema: dict) -> dict:
    return chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                tool_choice={"type": "function", "function": {"name": "f"}})


def requests_for(kind: str, spec: str) -> list[tuple[str, dict, str]]:
    """(endpoint, body, the field a 400 names) for each field that carries this kind of constraint."""
    if kind == "json":
        schema = json.loads(spec)
        return [("/v1/chat/completions", chat(response_format={"type": "json_schema",
                                                               "json_schema": {"name": "x", "schema": schema}}),
                 "response_format"),
                ("/v1/chat/completions", named_tool(schema), "tools"),
                ("/v1/completions", completion(guided_json=schema), "guided_json"),
                ("/v1/completions", completion(structured_outputs={"json": schema}), "structured_outputs")]
    if kind == "grammar":
        return [("/v1/completions", completion(guided_grammar=spec), "guided_grammar"),
                ("/v1/chat/completions", chat(structured_outputs={"grammar": spec}), "structured_outputs")]
    if kind == "regex":
        return [("/v1/completions", completion(guided_regex=spec), "guided_regex")]
    return [("/v1/completions", completion(guided_choice=json.loads(spec)), "guided_choice")]


@pytest.mark.parametrize("payload", CLASSES, ids=lambda payload: payload.name)
def test_each_class_over_its_bound_is_a_400_naming_the_field_and_the_limit(up, payload):
    for endpoint, body, param in requests_for(payload.kind, payload.spec(payload.over)):
        response = httpx.post(up.url + endpoint, json=body, timeout=60)
        error = assert_openai_error(response, 400, type_="invalid_request_error")
        assert error["param"] == param, (endpoint, error)
        for word in payload.words:
            assert word in error["message"], error["message"]


def test_20_crash_class_requests_in_a_minute_leave_the_router_serving(up):
    router_pid = up.pid_of("router")
    crashing = [request for kind, spec in [("grammar", lark_rule_chain(3_000)), ("json", schema_defs_chain(2_500)),
                                           ("json", schema_ref_chain(3_000))]
                for request in requests_for(kind, spec)]
    health = HealthWatch(up.url)
    started = time.monotonic()
    with health, ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda i: _post(up.url, *crashing[i % len(crashing)][:2]), range(20)))
    assert time.monotonic() - started < 60
    assert [response.status_code for response in responses] == [400] * 20, [r.text[:200] for r in responses]
    os.kill(router_pid, 0)  # the same router process
    assert not any("router ready" in line and "restart" in line for line in up.lines), up.lines
    assert health.worst_s <= HEALTH_BOUND_S and health.failures == 0, (health.worst_s, health.failures)
    answer = httpx.post(up.url + "/v1/completions", json=completion(guided_choice=["yes", "no"]), timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] in ("yes", "no"), answer.text
    log = (up.log_dir / "router.log").read_text()
    assert log.count("request from 127.0.0.1:") >= 20, "each sender is logged before its check"
    assert "characters)" in log and "d2400" not in log and 'r2999: r3000' not in log, "sizes, never payloads"


def _post(url: str, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(url + endpoint, json=body, timeout=60)


class HealthWatch:
    """/health polled on a thread while a block runs: the slowest answer and the failures."""

    def __init__(self, url: str) -> None:
        self.url, self.worst_s, self.failures = url, 0.0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._done.is_set():
            started = time.monotonic()
            try:
                ok = httpx.get(self.url + "/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.worst_s = max(self.worst_s, time.monotonic() - started)
            self.failures += not ok
            self._done.wait(0.1)


def test_a_constraint_that_crashes_the_compiler_is_a_400_and_its_sender_is_logged_first(monkeypatch, caplog):
    """As if a class escaped the bounds: the worker crashes, the router's check names the field, and the log
    names the sender before the worker died."""
    from pdserve.router.errors import InvalidRequest
    from pdserve.router.structured_output import Constraint, check_constraint

    monkeypatch.setattr("pdserve.engine.grammar.check_bounds", lambda kind, spec: None)
    spec = lark_rule_chain(3_017)  # a size no other test checks: not a cached verdict
    with caplog.at_level("INFO"), pytest.raises(InvalidRequest) as refused:
        check_constraint(Constraint("grammar", spec, "guided_grammar"), "10.0.0.7:51234 (x-request-id 'r1')")
    assert refused.value.param == "guided_grammar"
    assert "crashed the grammar compiler (SIGSEGV)" in str(refused.value)
    messages = [record.getMessage() for record in caplog.records]
    checking = next(i for i, m in enumerate(messages) if "checking its structured output" in m)
    died = next(i for i, m in enumerate(messages) if "died checking" in m)
    assert checking < died
    assert messages[checking] == (f"request from 10.0.0.7:51234 (x-request-id 'r1'): checking its structured output "
                                  f"(guided_grammar, grammar, {len(spec)} characters)")
    assert all(spec[:200] not in message for message in messages), "never the payload"
