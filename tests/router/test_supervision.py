"""`pdserve up` supervision: the restart policy's backoff and bound; a component that keeps failing
is given up and `up` ends when no decode engine is left; and with real processes, a decode engine
killed (-9) under load is restarted and the service answers again within a bound with no KV block
leaked, a SIGSTOPped engine is found stuck by its loop's progress file and restarted, and a killed
router comes back where clients and engines know it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pdserve.supervisor import Component, ComponentFailed, RestartPolicy, Supervisor
from tests.router.conftest import UpProcess, wait_no_kv_used

STALL_S = 4.0  # short for the test; the default is 120 s
RECOVERY_BOUND_S = 90.0  # restart + model load on a busy 2-core machine, with a wide margin
SUPERVISION = ("--max-restarts", "3", "--stall-timeout", f"{STALL_S:g}", "--heartbeat-timeout", "2")


# ---- the policy and the supervisor without a model ----

def test_backoff_doubles_per_recent_restart_and_restarts_are_bounded_per_window():
    policy = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.5, max_backoff_s=1.5)
    assert policy.delay([], 100.0) == 0.5
    assert policy.delay([90.0], 100.0) == 1.0
    assert policy.delay([80.0, 90.0], 100.0) == 1.5, "capped"
    assert policy.can_restart([80.0, 90.0], 100.0) and not policy.can_restart([70.0, 80.0, 90.0], 100.0)
    assert policy.can_restart([10.0, 20.0, 90.0], 100.0), "restarts older than the window do not count"
    assert policy.delay([10.0], 100.0) == 0.5
    assert not RestartPolicy(max_restarts=0).can_restart([], 0.0)


def test_a_decode_engine_that_keeps_dying_is_given_up_and_up_ends(tmp_path, capsys):
    supervisor = Supervisor(tmp_path, RestartPolicy(max_restarts=2, backoff_s=0.05))
    supervisor.start(Component("decode-0", [sys.executable, "-c", "import sys; sys.exit(3)"]))
    with pytest.raises(ComponentFailed, match="every decode engine"):
        supervisor.watch()
    component = supervisor.components[0]
    assert len(component.restart_times) == 2 and component.given_up
    err = capsys.readouterr().err
    assert err.count("decode-0 (pid") == 3 and "exited with code 3" in err
    assert "restarting decode-0 in 0.1s (restart 2 of at most 2" in err
    assert "decode-0 is not restarted: 2 restarts within 600s are used up" in err
    assert (tmp_path / "decode-0.log").read_text().count("---- [pdserve up] restart") == 2


FULL_LOG_SCENARIO = """
import resource, signal, sys
from pathlib import Path
from pdserve.supervisor import Component, ComponentFailed, RestartPolicy, Supervisor

log_dir = Path(sys.argv[1])
supervisor = Supervisor(log_dir, RestartPolicy(max_restarts=2, backoff_s=0.05))
supervisor.start(Component("decode-0", [sys.executable, "-c", "import sys; sys.exit(3)"]))
supervisor.components[0].process.wait()
(log_dir / "decode-0.log").write_text("x" * 999 + "\\n")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as one on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # the log cannot grow
try:
    supervisor.watch()
except ComponentFailed as exc:
    print("ENDED:", exc, len(supervisor.components[0].restart_times))
"""


def test_a_restart_whose_log_cannot_grow_is_a_failed_restart_not_the_end_of_up(tmp_path):
    """A full disk: the restart header's write raised out of watch() ("pdserve up: error: [Errno 28] No space left
    on device") and `up` stopped the router and every engine still serving. Here the log cannot grow (a file size
    limit, EFBIG) in a process of its own."""
    result = subprocess.run([sys.executable, "-c", FULL_LOG_SCENARIO, str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert "ENDED: decode-0 failed, and so did every decode engine, restarts used up 2" in result.stdout, (
        result.stdout + result.stderr)
    assert "Traceback" not in result.stderr


def test_a_restart_whose_log_cannot_be_opened_is_a_failed_restart(tmp_path, capsys):
    supervisor = Supervisor(tmp_path, RestartPolicy(max_restarts=2, backoff_s=0.05))
    supervisor.start(Component("decode-0", [sys.executable, "-c", "import sys; sys.exit(3)"]))
    supervisor.components[0].process.wait()
    (tmp_path / "decode-0.log").unlink()
    (tmp_path / "decode-0.log").mkdir()  # open() fails: IsADirectoryError (it raised out of watch())
    with pytest.raises(ComponentFailed, match="every decode engine"):
        supervisor.watch()
    assert len(supervisor.components[0].restart_times) == 2 and supervisor.components[0].given_up
    err = capsys.readouterr().err
    assert err.count("could not be restarted ([Errno 21] Is a directory") == 2, err


def test_a_failure_says_when_the_disk_of_the_logs_is_full(tmp_path, capsys, monkeypatch):
    from pdserve import supervisor as supervision

    full = os.statvfs_result((4096, 4096, 100, 0, 0, 10, 0, 0, 0, 255))  # no block free
    monkeypatch.setattr(supervision.os, "statvfs", lambda path: full)
    assert supervision.full_disk_note(tmp_path).startswith(f" (note: the disk holding {tmp_path} has 0 bytes free")
    watcher = Supervisor(tmp_path, RestartPolicy(max_restarts=0))
    watcher.start(Component("decode-0", [sys.executable, "-c", "import sys; sys.exit(1)"]))
    with pytest.raises(ComponentFailed):
        watcher.watch()
    err = capsys.readouterr().err
    assert "exited with code 1 (note: the disk holding" in err and "give --log-dir on another disk" in err
    monkeypatch.undo()
    assert supervision.full_disk_note(tmp_path) == "", "this test's own disk has room"


# ---- `pdserve up` with real processes ----

@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    up = UpProcess(tiny_model, tmp_path_factory.mktemp("up-supervised"), "--num-prefill", "1", "--num-decode", "1",
                   *SUPERVISION)
    reader = threading.Thread(target=_read_lines, args=(up,), daemon=True)
    reader.start()
    yield up
    assert up.stop() == 0, "".join(up.lines) + up.logs()


def _read_lines(up: UpProcess) -> None:
    try:
        for line in up.process.stdout:
            up.lines.append(line)
    except ValueError:  # stdout closed by stop()
        pass


def wait_for_line(up: UpProcess, text: str, timeout: float, also: str = "") -> str:
    """The last line of `up`'s output holding text (and also), waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in list(up.lines) if text in line and also in line]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no line with {text!r} within {timeout}s:\n" + "".join(up.lines) + up.logs())


def latest_pid(up: UpProcess, name: str) -> int:
    line = [line for line in list(up.lines) if line.startswith(f"[pdserve up] {name} ready")][-1]
    return int(line.split(" pid ")[1].split(",")[0])


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=30)


def complete(client, model: str, prompt: str = "def main():"):
    return client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})


class Load:
    """A few clients sending requests back to back, counting what succeeds and what fails."""

    def __init__(self, client, model: str, num_clients: int = 2) -> None:
        self.num_ok = self.num_failed = 0
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(client, model, i), daemon=True)
                         for i in range(num_clients)]
        for thread in self._threads:
            thread.start()

    def _run(self, client, model: str, index: int) -> None:
        while not self._done.is_set():
            try:
                complete(client, model, f"import os\nclass Parser{index}:")
                self.num_ok += 1
            except openai.APIError:
                self.num_failed += 1
                time.sleep(0.1)

    def stop(self) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(timeout=60)


def first_success_after(client, model: str, since: float) -> float:
    """Seconds from `since` to the first request that succeeds."""
    while time.monotonic() - since < RECOVERY_BOUND_S:
        try:
            complete(client, model)
            return time.monotonic() - since
        except openai.APIError:
            time.sleep(0.05)
    raise AssertionError(f"no request succeeded within {RECOVERY_BOUND_S}s")


def assert_routes_to_all_and_no_kv_used(url: str) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").json()["engines"] != {"prefill": 1, "decode": 1}:
        assert time.monotonic() < deadline, "the restarted engine never joined routing"
        time.sleep(0.1)
    used = wait_no_kv_used(url, timeout=45)  # a prefill whose decode died holds KV until its KVWant timeout
    assert set(used) == {(("engine", "prefill-0"), ("role", "prefill")), (("engine", "decode-0"), ("role", "decode"))}
    assert all(value == 0 for value in used.values()), used


def test_a_killed_decode_engine_is_restarted_and_the_service_returns(cluster, client, tiny_model):
    load = Load(client, tiny_model)
    try:
        while load.num_ok < 3:
            time.sleep(0.05)
        pid = latest_pid(cluster, "decode-0")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        recovery_s = first_success_after(client, tiny_model, killed)
    finally:
        load.stop()
    print(f"\nkill -9 decode-0 -> first successful request: {recovery_s:.2f}s "
          f"(load: {load.num_ok} ok, {load.num_failed} failed)")
    assert f"decode-0 (pid {pid}) was killed by SIGKILL" in wait_for_line(cluster, f"(pid {pid})", 5)
    wait_for_line(cluster, "decode-0 ready", 5, also="; restart 1)")
    assert latest_pid(cluster, "decode-0") != pid
    router_log = (cluster.log_dir / "router.log").read_text()
    assert "the link to engine decode-0" in router_log and "broke: it leaves routing" in router_log, \
        "the router noticed the dropped connection, not missed heartbeats"
    assert_routes_to_all_and_no_kv_used(cluster.url)


def test_a_stopped_engine_is_found_stuck_and_restarted(cluster, client, tiny_model):
    pid = latest_pid(cluster, "prefill-0")
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    line = wait_for_line(cluster, f"prefill-0 (pid {pid}) made no progress", STALL_S + 15)
    assert f"--stall-timeout {STALL_S:g}" in line
    assert time.monotonic() - stopped >= STALL_S - 1, "the loop touches its file every 0.5 s: not sooner"
    wait_for_line(cluster, "prefill-0 ready", RECOVERY_BOUND_S, also="; restart 1)")
    assert latest_pid(cluster, "prefill-0") != pid
    assert complete(client, tiny_model).choices[0].finish_reason == "length"
    assert_routes_to_all_and_no_kv_used(cluster.url)


def test_a_killed_router_comes_back_on_its_port_and_the_engines_find_it(cluster, client, tiny_model):
    pid = latest_pid(cluster, "router")
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    recovery_s = first_success_after(client, tiny_model, killed)  # the same URL: the same port
    print(f"\nkill -9 router -> first successful request: {recovery_s:.2f}s")
    assert f"router (pid {pid}) was killed by SIGKILL" in wait_for_line(cluster, f"(pid {pid})", 5)
    wait_for_line(cluster, "router ready", 5, also="; restart 1)")
    assert_routes_to_all_and_no_kv_used(cluster.url)
