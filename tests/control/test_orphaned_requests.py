"""A request whose sender is gone (a router that died: its connection closed) is aborted at its next
token, and its blocks go back, instead of decoding to max_tokens for nobody."""

from __future__ import annotations

import time

from pdserve.control.messages import TokenDelta
from pdserve.local_cluster import Driver, EngineProcess
from tests.router.test_migration_up import DEEP_LAYERS

ENGINE_ARGS = ("--block-size", "4", "--num-kv-blocks", "256")


def test_a_request_of_a_vanished_router_is_aborted_and_frees_its_blocks(model_factory, tmp_path):
    # the tiny model 16 layers deep: 450 tokens of the 2-layer one could all be decoded before the engine
    # noticed the closed connection on a busy host, and nothing would be left to abort
    decode = EngineProcess("decode", model_factory("llama", num_hidden_layers=DEEP_LAYERS), *ENGINE_ARGS,
                           log_dir=tmp_path)
    doomed, survivor = Driver(decode), Driver(decode)
    try:
        doomed.submit("orphan", list(range(10, 40)), remote=False, temperature=0.0, max_tokens=450, ignore_eos=True)
        deadline = time.monotonic() + 30
        while not isinstance(getattr(doomed.decode.recv(timeout=0.1), "msg", None), TokenDelta):
            assert time.monotonic() < deadline, "no token from the engine"
        doomed.close()  # the router dies: its connection closes
        stats, _ = survivor.wait_idle(timeout_s=30)
        assert stats.kv_blocks_used == 0 and stats.num_running == 0
        assert "request orphan aborted: the router that sent it is gone" in decode.log()
        result, = survivor.generate([list(range(10, 20))], temperature=0.0, max_tokens=4, ignore_eos=True)
        assert result.finish_reason == "length", "the engine serves the other router as before"
    finally:
        survivor.close()
        decode.stop()
