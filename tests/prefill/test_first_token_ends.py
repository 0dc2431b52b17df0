"""The prefill server alone knows which requests their first token ends (max_tokens=1, or no room in the context for
a second token): their computed prompts free their blocks at once and their length finish goes to the router; every
other request's prompt waits for its decode engine, and its finish is the decode engine's to give. Nothing of either
is left behind, an aborted request's included."""

from __future__ import annotations

import pytest

from pdserve.control.messages import Abort, PrefillRequest
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.request import SamplingParams
from pdserve.prefill.service import PrefillOptions, build_prefill_server

ROUTER = b"router"


@pytest.fixture
def server(model_factory):
    server = build_prefill_server(ModelConfig.from_hf(model_factory("llama"), dtype="float32"), CacheConfig(16, 96),
                                  SchedulerConfig(), PrefillOptions(stream_layers=False))
    yield server
    server.close()


def _send(server, request_id: str, prompt_len: int, max_tokens: int | None) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = [3 + i % 50 for i in range(prompt_len)]
    server.handle(ROUTER, PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))


def test_only_requests_that_go_on_keep_their_blocks_and_lose_their_length_finish(server):
    max_model_len = server.engine.model_config.max_model_len
    _send(server, "one_token", 8, 1)
    _send(server, "no_room", max_model_len - 1, None)
    _send(server, "goes_on", 8, 8)
    _send(server, "aborted", 8, 8)
    server.handle(ROUTER, Abort(request_id="aborted"))
    sent = {}
    for delta in server.engine.step():  # the three prompts in one step, and the abort
        message = server.outgoing(delta)
        sent[delta.request_id] = message.finish_reason if message is not None else "not sent"
    assert sent == {"one_token": "length", "no_room": "length", "goes_on": None, "aborted": "not sent"}
    assert set(server.engine.scheduler.delayed_free) == {"goes_on"}, "held for its decode engine; the others went"
    assert not server.continuing
