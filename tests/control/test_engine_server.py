"""The engine loop's control plane without a model: what a peer hears back for a request it got wrong,
and the progress file the loop touches as it goes round."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from pdserve.control.engine_server import EngineServer
from pdserve.control.messages import Error, GenerateRequest, TokenDelta
from pdserve.control.protocol import decode
from pdserve.control.sampling_params import SamplingParams

WAIT_S = 5.0


@pytest.fixture
def server():
    server = EngineServer(engine=None, kv_transfer=None, control_address="tcp://127.0.0.1:0", engine_id="e0")
    yield server
    server.control.close()


def ask(server: EngineServer, **sampling):
    """Send a GenerateRequest header whose sampling values are changed as given; the engine's answer."""
    header = GenerateRequest(request_id="req-1", prompt_token_ids=[1, 2],
                             sampling_params=SamplingParams(max_tokens=2)).to_header()
    header["sampling_params"].update(sampling)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(server.control_address)
    try:
        peer.send_multipart([msgpack.packb(header)])
        deadline = time.monotonic() + WAIT_S
        while not peer.poll(10):
            server._drain_control()
            assert time.monotonic() < deadline, "the engine never answered"
        return decode(peer.recv_multipart())[0]
    finally:
        peer.close()


def test_sampling_out_of_range_ends_the_request_as_invalid(server):
    answer = ask(server, temperature=-1.0)
    assert isinstance(answer, TokenDelta)
    assert (answer.request_id, answer.finish_reason, answer.error_code) == ("req-1", "error", "invalid_request")
    assert "temperature=-1.0 must be >= 0" in answer.error


def test_a_malformed_sampling_field_is_a_protocol_error(server):
    answer = ask(server, top_k="5")
    assert isinstance(answer, Error)
    assert (answer.code, answer.request_id) == ("protocol_error", "req-1")
    assert "generate.sampling_params.top_k: expected int" in answer.message


class IdleEngine:
    """An engine double with nothing to do, and a KV transfer side with no sockets."""

    def has_runnable_work(self) -> bool:
        return False

    def has_work(self) -> bool:
        return False

    def sockets(self) -> list:
        return []

    def receive(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_loop_touches_its_progress_file_as_it_goes_round(tmp_path):
    idle = IdleEngine()
    server = EngineServer(engine=idle, kv_transfer=idle, control_address="tcp://127.0.0.1:0", engine_id="e0")
    progress = tmp_path / "e0.progress"
    server.enable_progress_file(str(progress))
    os.utime(progress, (0, 0))  # as old as can be
    loop = threading.Thread(target=server.run)
    loop.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while progress.stat().st_mtime < time.time() - 60:
            assert time.monotonic() < deadline, "the loop never marked its progress"
            time.sleep(0.05)
    finally:
        server.stop()
        loop.join(timeout=WAIT_S)
    assert not loop.is_alive()


class LinkThatDrops(IdleEngine):
    """A KV transfer side with one link socket, which it drops (closes, and lists no more) on request, as a
    decode engine drops a link to a prefill engine that took nothing for 2 s; counts the loop's rounds."""

    def __init__(self) -> None:
        self.link = zmq.Context.instance().socket(zmq.DEALER)
        self.link.connect("tcp://127.0.0.1:9")  # nobody answers there
        self.drop_now = threading.Event()
        self.dropped = False
        self.rounds = 0

    def sockets(self) -> list:
        return [] if self.dropped else [self.link]

    def receive(self) -> None:  # on the loop's thread, as the real transfer side drops a link
        self.rounds += 1
        if self.drop_now.is_set() and not self.dropped:
            self.link.close(linger=0)
            self.dropped = True


def test_an_idle_loop_waits_after_a_kv_link_was_dropped():
    """A closed socket left in the loop's poller made every poll return at once: the idle engine spun a core
    (an outside probe saw a decode engine at 100% for as long as it ran)."""
    side = LinkThatDrops()
    server = EngineServer(engine=side, kv_transfer=side, control_address="tcp://127.0.0.1:0", engine_id="e0")
    loop = threading.Thread(target=server.run)
    loop.start()
    try:
        time.sleep(0.2)  # the link is in the poller
        side.drop_now.set()
        time.sleep(0.1)
        before = side.rounds
        time.sleep(0.5)
        rounds = side.rounds - before
    finally:
        server.stop()
        loop.join(timeout=WAIT_S)
    assert side.dropped and not loop.is_alive()
    assert 5 <= rounds <= 0.5 / 0.020 + 5, f"{rounds} rounds in 0.5 s while idle (a round waits 20 ms for input)"


class EngineOfSteps(IdleEngine):
    """An engine double that always has a step to run; logs each step into `events`."""

    def __init__(self, events: list, server_stop) -> None:
        self.events = events
        self.server_stop = server_stop

    def has_runnable_work(self) -> bool:
        return True

    def has_work(self) -> bool:
        return True

    def step(self) -> list:
        self.events.append("step")
        if self.events.count("step") == 3:
            self.server_stop()
        return []

    def take_prompt_logprobs(self) -> list:
        return []


def test_the_loop_gives_up_its_core_after_each_step(monkeypatch):
    """A loop with runnable work never blocks, so zmq's I/O thread, which writes what a step sent and shares the
    core of an engine pinned to one, waited for the kernel's next tick (4 ms) before the first token left."""
    events: list[str] = []
    monkeypatch.setattr("pdserve.control.engine_server.os.sched_yield", lambda: events.append("yield"))
    server = EngineServer(engine=None, kv_transfer=None, control_address="tcp://127.0.0.1:0", engine_id="e0")
    server.engine = server.kv_transfer = EngineOfSteps(events, server.stop)
    server.run()
    assert events == ["step", "yield"] * 3


SIGNAL_STORM = """
import os, signal, sys
from pdserve.control.engine_server import EngineServer
from tests.control.test_engine_server import IdleEngine

for second_at in range(1, 40):  # the second SIGTERM lands at each line the first one's handling runs, in turn
    lines = 0

    def second_signal(frame, event, arg):
        global lines
        if event == "line":
            lines += 1
            if lines == second_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return second_signal

    idle = IdleEngine()
    server = EngineServer(engine=idle, kv_transfer=idle, control_address="tcp://127.0.0.1:0", engine_id="e0")
    server.install_signal_handlers()
    sys.settrace(second_signal)
    os.kill(os.getpid(), signal.SIGTERM)
    server.run()  # returns at once: it was told to stop
    sys.settrace(None)
    assert server.stopping
print("every loop left")
"""


def test_a_second_sigterm_during_the_first_ones_handling_does_not_hang_the_engine():
    """`pdserve engine` pressed Ctrl-C twice, a supervisor's repeated SIGTERM: the handler once set a threading.Event,
    and a second signal handled while the first held that Event's lock waited on it forever (engines killed after
    30 s instead of stopping). Run apart: a hang here is the subprocess's timeout, not the test run's."""
    try:
        result = subprocess.run([sys.executable, "-c", SIGNAL_STORM], capture_output=True, text=True, timeout=60,
                                cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        pytest.fail("the engine loop hung after a second SIGTERM (its handler must take no lock)")
    assert result.returncode == 0 and "every loop left" in result.stdout, result.stderr[-2000:]
