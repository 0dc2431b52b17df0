"""`pdserve up` starts the engines while the router loads its tokenizer: the router's failure is still the one
reported when both fail, and an engine's failure is reported once the router is ready (real child processes;
under `pdserve up` itself: tests/router/test_launcher_and_compose.py, a missing model that fails every process)."""

from __future__ import annotations

import sys

import pytest

from pdserve.supervisor import Component, ComponentFailed, RestartPolicy, Supervisor


def child(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys, time\n{code}"]


READY_LATER = child("time.sleep(1.0); print('PDSERVE_READY role=router url=http://x registration=tcp://y', flush=True)"
                    "; time.sleep(60)")
FAILS_LATER = child("time.sleep(1.0); sys.exit(2)")
FAILS_AT_ONCE = child("sys.exit(5)")


def started(tmp_path, *components: Component) -> Supervisor:
    supervisor = Supervisor(tmp_path, RestartPolicy())
    for component in components:
        supervisor.start(component)
    return supervisor


def start_failure(tmp_path, router: Component, engine: Component) -> ComponentFailed:
    """What wait_ready raises for the router and an engine started together, the router first."""
    supervisor = started(tmp_path, router, engine)
    try:
        with pytest.raises(ComponentFailed) as failed:
            supervisor.wait_ready([router, engine], deadline=float("inf"), first=router)
        return failed.value
    finally:
        supervisor.stop_all()


def test_the_router_failing_after_an_engine_is_the_failure_reported(tmp_path):
    router, engine = Component("router", FAILS_LATER), Component("decode-0", FAILS_AT_ONCE)
    failed = start_failure(tmp_path, router, engine)
    assert failed.component is router and str(failed) == "router exited with code 2"


def test_an_engine_failing_while_the_router_loads_is_reported_once_the_router_is_ready(tmp_path, capsys):
    router, engine = Component("router", READY_LATER), Component("decode-0", FAILS_AT_ONCE)
    failed = start_failure(tmp_path, router, engine)
    assert failed.component is engine and str(failed) == "decode-0 exited with code 5"
    assert router.ready == {"role": "router", "url": "http://x", "registration": "tcp://y"}
    assert "router ready (http://x" in capsys.readouterr().out


def test_find_line_reads_only_this_run_of_the_log(tmp_path):
    router = Component("router", child("print('PDSERVE_REGISTRATION registration=tcp://127.0.0.1:5', flush=True)"))
    supervisor = started(tmp_path, router)
    router.process.wait(timeout=30)
    assert supervisor.find_line(router, "PDSERVE_REGISTRATION ") == {"registration": "tcp://127.0.0.1:5"}
    assert supervisor.find_line(router, "PDSERVE_READY ") is None
    router.log_offset = router.log_path.stat().st_size  # a restart appends to the log: its lines start here
    assert supervisor.find_line(router, "PDSERVE_REGISTRATION ") is None

