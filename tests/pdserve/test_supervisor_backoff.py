"""A crash loop of the router never becomes an outage: past its restart budget the supervisor restarts it
on, with a backoff that doubles up to its cap, where an engine is given up (tests/router/test_supervision.py)."""

from __future__ import annotations

import re
import sys
import threading
import time

from pdserve.supervisor import Component, RestartPolicy, Supervisor


def test_only_the_router_is_restarted_past_the_budget_and_not_when_restarts_are_off():
    policy = RestartPolicy(max_restarts=2)
    assert policy.keeps_restarting("router")
    assert not policy.keeps_restarting("decode-0") and not policy.keeps_restarting("prefill-0")
    assert not RestartPolicy(max_restarts=0).keeps_restarting("router")


def test_a_router_that_keeps_dying_is_restarted_past_its_budget_with_a_capped_backoff(tmp_path, capsys):
    policy = RestartPolicy(max_restarts=2, backoff_s=0.1, max_backoff_s=0.4)
    supervisor = Supervisor(tmp_path, policy)
    supervisor.start(Component("router", [sys.executable, "-c", "import sys; sys.exit(3)"]))
    router = supervisor.components[0]
    watching = threading.Thread(target=supervisor.watch)
    watching.start()
    deadline = time.monotonic() + 60
    while len(router.restart_times) < 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.stopping = True
    watching.join(timeout=10)
    supervisor.stop_all()
    assert not watching.is_alive(), "watch() raised or hung: the router's crash loop ended the service"
    assert len(router.restart_times) >= 7 and not router.given_up
    err = capsys.readouterr().err
    delays = [float(delay) for delay in re.findall(r"restarting router in ([0-9.]+)s", err)]
    assert delays[:3] == [0.1, 0.2, 0.4] and len(delays) >= 7 and set(delays[3:]) == {0.4}, delays
    gaps = [later - earlier for earlier, later in zip(router.restart_times, router.restart_times[1:])]
    assert all(gap >= delay - 0.01 for gap, delay in zip(gaps, delays[1:])), (gaps, delays)
    assert "restarting router in 0.4s: its 2 restarts within 600s are used up" in err
    assert "is not restarted" not in err
