"""CURVE on every link: engines started with --curve-dir talk only to holders of the cluster keys."""

from __future__ import annotations

import pytest

from pdserve.control.errors import TransportTimeout
from pdserve.control.keys import CurveClientConfig, generate_curve_keypair, load_cluster_keys, write_cluster_keys
from pdserve.control.messages import GenerateRequest
from pdserve.control.sampling_params import SamplingParams
from pdserve.control.sockets import ClientSocket
from pdserve.kvtransfer.messages import Hello
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_disaggregated import (
    ENGINE_ARGS,
    GREEDY,
    PROMPTS,
    assert_no_leaks,
    colocated_tokens,
)
from tests.decode.test_disaggregated import start_at_free_kv_addresses, stop_together

GENERATE = GenerateRequest(request_id="x", prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=2))
HELLO = Hello(fingerprint={}, role="decode", engine_id="outsider")


def test_encrypted_cluster_serves_key_holders_only(model_factory, tmp_path):
    model_dir = model_factory("llama")
    keys = write_cluster_keys(tmp_path / "keys")
    curve = ("--curve-dir", str(keys))
    prefill, decode = start_at_free_kv_addresses(
        1, lambda kv: EngineProcess("prefill", model_dir, *ENGINE_ARGS, *curve, "--kv-address", kv[0],
                                    log_dir=tmp_path),
        lambda kv: EngineProcess("decode", model_dir, *ENGINE_ARGS, *curve, "--kv-peer", kv[0], log_dir=tmp_path))
    driver = Driver(decode, prefill, curve=load_cluster_keys(keys).client)
    try:
        results = driver.generate(PROMPTS[:3], **GREEDY)
        assert [r.token_ids for r in results] == colocated_tokens(model_dir, PROMPTS[:3], **GREEDY)
        assert driver.decode_stats().kv_bytes_received > 0, "the KV link itself ran under CURVE"
        assert_no_leaks(driver)
        other_keys = load_cluster_keys(write_cluster_keys(tmp_path / "other"))
        server_public = load_cluster_keys(keys).client.server_public_key  # public: assume anyone knows it
        outsiders = {"a stranger without keys": None, "an impostor with other keys": other_keys.client,
                     "a peer holding only the server's public key": CurveClientConfig(generate_curve_keypair(),
                                                                                       server_public)}
        planes = {"decode control": (decode.addresses["control"], GENERATE),
                  "prefill control": (prefill.addresses["control"], GENERATE),
                  "prefill KV link": (prefill.addresses["kv"], HELLO)}
        for plane, (address, msg) in planes.items():
            for who, curve in outsiders.items():
                # a key holder's handshake on loopback takes milliseconds: 0.5 s without one is a refusal
                with ClientSocket(address, curve=curve, send_timeout=0.5) as outsider:
                    with pytest.raises(TransportTimeout):  # the handshake never completes: nothing is taken
                        outsider.send(msg)
                        pytest.fail(f"the {plane} took a message from {who}")
        assert driver.generate(PROMPTS[:1], prefix="after", **GREEDY)[0].finish_reason == "length"
    finally:
        driver.close()
        stop_together(prefill, decode)
