"""CURVE on every link: engines started with --curve-dir talk only to holders of the cluster keys."""

from __future__ import annotations

import pytest

from pdserve.control.errors import TransportTimeout
from pdserve.control.keys import load_cluster_keys, write_cluster_keys
from pdserve.control.messages import GenerateRequest
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.sockets import ClientSocket
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import (
    ENGINE_ARGS,
    GREEDY,
    PROMPTS,
    assert_no_leaks,
    colocated_tokens,
)

TWO_TOKENS = SamplingParams(max_tokens=2)


def test_encrypted_cluster_serves_key_holders_only(model_factory, tmp_path):
    model_dir = model_factory("llama")
    keys = write_cluster_keys(tmp_path / "keys")
    curve = ("--curve-dir", str(keys))
    prefill = EngineProcess("prefill", model_dir, *ENGINE_ARGS, *curve, log_dir=tmp_path)
    decode = EngineProcess("decode", model_dir, *ENGINE_ARGS, *curve, *prefill.kv_peer_args(), log_dir=tmp_path)
    driver = Driver(decode, prefill, curve=load_cluster_keys(keys).client)
    try:
        results = driver.generate(PROMPTS[:3], **GREEDY)
        assert [r.token_ids for r in results] == colocated_tokens(model_dir, PROMPTS[:3], **GREEDY)
        assert driver.decode_stats().kv_bytes_received > 0, "the KV link itself ran under CURVE"
        assert_no_leaks(driver)
        with ClientSocket(decode.addresses["control"], send_timeout=1.0) as stranger:  # no keys
            with pytest.raises(TransportTimeout):
                stranger.send(GenerateRequest(request_id="x", prompt_token_ids=[1, 2], sampling_params=TWO_TOKENS))
        other_keys = load_cluster_keys(write_cluster_keys(tmp_path / "other"))
        with ClientSocket(decode.addresses["control"], curve=other_keys.client, send_timeout=1.0) as impostor:
            with pytest.raises(TransportTimeout):
                impostor.send(GenerateRequest(request_id="y", prompt_token_ids=[1, 2], sampling_params=TWO_TOKENS))
    finally:
        driver.close()
        prefill.stop()
        decode.stop()
