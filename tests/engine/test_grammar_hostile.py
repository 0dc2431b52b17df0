"""Hostile structured-output constraints (issue 49): every payload class over its bound is refused by name
before anything compiles it; the largest payloads under the bounds compile without a crash; and what
crashed llguidance (a segfault) fails only its own check in a worker process, which is replaced, while
this process, the engine's compiler, and later checks carry on."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pdserve.control.errors import InvalidRequestError
from pdserve.engine.grammar_limits import GrammarLimitError, check_bounds
from pdserve.engine.grammar_sandbox import GrammarSandbox, SandboxConfig
from pdserve.engine.request import SamplingParams
from pdserve.engine.structured_output import StructuredOutputCompiler
from tests.engine.hostile_grammars import CLASSES, CRASHING, lark_alternation

pytestmark = pytest.mark.hostile

SMALL_SCHEMA = '{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}'


@pytest.fixture(scope="module")
def sandbox():
    sandbox = GrammarSandbox(SandboxConfig(num_workers=2))
    yield sandbox
    sandbox.close()


@pytest.mark.parametrize("payload", CLASSES, ids=lambda payload: payload.name)
def test_each_class_over_its_bound_is_refused_naming_the_limit(payload):
    with pytest.raises(GrammarLimitError) as refused:
        check_bounds(payload.kind, payload.spec(payload.over))
    for word in payload.words:
        assert word in str(refused.value), str(refused.value)


@pytest.mark.parametrize("payload", CLASSES, ids=lambda payload: payload.name)
def test_the_largest_payload_under_each_bound_is_within_it_and_does_not_crash_the_compiler(payload, sandbox):
    spec = payload.spec(payload.under)
    check_bounds(payload.kind, spec)
    deaths = sandbox.num_worker_deaths
    problem = sandbox.check(payload.kind, spec)  # on a quarter of the usual stack: any thread here takes it
    assert sandbox.num_worker_deaths == deaths, problem
    assert problem is None or "does not compile" in problem, problem


def test_what_crashed_the_compiler_fails_its_check_and_the_worker_is_replaced(sandbox):
    for kind, spec in CRASHING:
        deaths = sandbox.num_worker_deaths
        problem = sandbox.check(kind, spec)
        assert "crashed the grammar compiler (SIGSEGV)" in problem, problem
        assert sandbox.num_worker_deaths == deaths + 2, "tried once more on a fresh worker"
        assert sandbox.check("json", SMALL_SCHEMA) is None, "a later check is served"
    checks = sandbox.num_checks
    assert "crashed" in sandbox.check(*CRASHING[0]), "a crash's verdict is kept"
    assert sandbox.num_checks == checks, "and a repeat costs no worker"


def test_a_worker_killed_by_its_pid_while_idle_is_restarted(sandbox):
    sandbox.check("regex", "[a-z]+")
    sandbox.check("regex", "[0-9]+")
    victims = sandbox.worker_pids()
    assert victims
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    for n in range(4):
        assert sandbox.check("regex", f"x{{{n + 1}}}") is None
    assert not set(sandbox.worker_pids()) & set(victims)


def test_a_worker_killed_during_a_check_is_replaced_and_the_check_runs_again():
    sandbox = GrammarSandbox(SandboxConfig(num_workers=2, timeout_s=60))
    try:
        _kill_during_a_check(sandbox)
    finally:
        sandbox.close()


def _kill_during_a_check(sandbox: GrammarSandbox) -> None:
    slow = lark_alternation(60_000)  # over the bound (the sandbox does not check bounds): ~1-2 s to compile
    sandbox.check("regex", "warm")
    sandbox.check("regex", "warm2")
    pids, deaths = sandbox.worker_pids(), sandbox.num_worker_deaths
    verdict = {}
    checking = threading.Thread(target=lambda: verdict.setdefault("problem", sandbox.check("grammar", slow)))
    checking.start()
    busy = []
    deadline = time.monotonic() + 10
    while not busy and time.monotonic() < deadline:  # the worker that took the job left the idle ones
        busy = sorted(set(pids) - set(sandbox.worker_pids()))
        time.sleep(0.01)
    os.kill(busy[0], signal.SIGKILL)
    checking.join(timeout=60)
    assert verdict == {"problem": None}, "the check ran again on a fresh worker"
    assert sandbox.num_worker_deaths == deaths + 1
    assert busy[0] not in sandbox.worker_pids()
    assert sandbox.check("json", SMALL_SCHEMA) is None


def test_a_check_past_its_time_limit_is_killed_and_not_kept():
    sandbox = GrammarSandbox(SandboxConfig(num_workers=1, timeout_s=0.3))
    try:
        sandbox.check("regex", "warm")
        slow = lark_alternation(60_000)
        assert "took longer than 0.3s to compile" in sandbox.check("grammar", slow)
        checks = sandbox.num_checks
        sandbox.check("grammar", slow)
        assert sandbox.num_checks == checks + 1, "a timeout may be the machine's load: checked again"
        assert sandbox.check("regex", "ok") is None
    finally:
        sandbox.close()


def test_the_engine_refuses_what_is_over_a_bound_and_survives_what_crashes_its_compiler(model_factory,
                                                                                       monkeypatch):
    model_dir = model_factory("llama")
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    compiler = StructuredOutputCompiler(model_dir, vocab_size)
    for kind, spec in CRASHING:
        with pytest.raises(InvalidRequestError, match="over the limit|nests deeper"):
            compiler.grammar_state(SamplingParams(structured_kind=kind, structured_spec=spec))
    # Without the bounds (as if one missed a class), the worker crashes instead of the engine
    monkeypatch.setattr("pdserve.engine.grammar.check_bounds", lambda kind, spec: None)
    with pytest.raises(InvalidRequestError, match="crashed the grammar compiler"):
        compiler.grammar_state(SamplingParams(structured_kind="grammar", structured_spec=CRASHING[0][1]))
    assert compiler.num_compiled == 0
    state = compiler.grammar_state(SamplingParams(structured_kind="json", structured_spec=SMALL_SCHEMA))
    assert state is not None and compiler.num_compiled == 1


def test_a_worker_that_cannot_start_fails_the_check_without_blaming_the_constraint():
    sandbox = GrammarSandbox(SandboxConfig(num_workers=1, memory_bytes=20 << 20))  # too small to import Python
    try:
        problem = sandbox.check("regex", "[a-z]+")
        assert "the grammar checker process did not start: retry later" in problem, problem
        assert not sandbox.cached("regex", "[a-z]+")
    finally:
        sandbox.close()
