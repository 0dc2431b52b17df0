"""The engine loop's control plane without a model: what a peer hears back for a request it got wrong,
and the progress file the loop touches as it goes round."""

from __future__ import annotations

import os
import threading
import time

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
