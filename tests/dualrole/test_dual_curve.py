"""Two dual-role engines with the cluster's CURVE keys: each pulls KV from the other over an encrypted,
authenticated link, and an outsider without the keys gets nothing through either plane."""

from __future__ import annotations

import pytest

from pdserve.control.errors import TransportTimeout
from pdserve.control.keys import load_cluster_keys, write_cluster_keys
from pdserve.control.sockets import ClientSocket
from pdserve.local_cluster import Driver, EngineProcess
from tests.decode.test_curve import GENERATE, HELLO
from tests.decode.test_disaggregated import ENGINE_ARGS, GREEDY, PROMPTS, assert_no_leaks, colocated_tokens
from tests.decode.test_disaggregated import start_together, stop_together


def test_dual_engines_pull_from_each_other_under_curve(model_factory, tmp_path):
    model_dir = model_factory("llama")
    keys = write_cluster_keys(tmp_path / "keys")
    curve = ("--curve-dir", str(keys))
    kv = {name: f"ipc://{tmp_path}/{name}-kv.sock" for name in ("a", "b")}
    a, b = start_together(
        lambda: EngineProcess("engine", model_dir, *ENGINE_ARGS, *curve, "--kv-address", kv["a"], "--kv-peer", kv["b"],
                              log_dir=tmp_path),
        lambda: EngineProcess("engine", model_dir, *ENGINE_ARGS, *curve, "--kv-address", kv["b"], "--kv-peer", kv["a"],
                              log_dir=tmp_path))
    client = load_cluster_keys(keys).client
    a_to_b, b_to_a = Driver(b, a, curve=client), Driver(a, b, curve=client)
    try:
        expected = colocated_tokens(model_dir, PROMPTS[:3], **GREEDY)
        for i, prompt in enumerate(PROMPTS[:3]):
            a_to_b.submit(f"ab{i}", prompt, **GREEDY)
            b_to_a.submit(f"ba{i}", prompt, **GREEDY)
        for prefix, driver in (("ab", a_to_b), ("ba", b_to_a)):
            results = driver.collect([f"{prefix}{i}" for i in range(3)])
            assert [results[f"{prefix}{i}"].token_ids for i in range(3)] == expected
            assert driver.decode_stats().kv_bytes_received > 0, "the KV link ran under CURVE"
            assert_no_leaks(driver)
        for address, msg in ((a.addresses["control"], GENERATE), (a.addresses["kv"], HELLO)):
            with ClientSocket(address, curve=None, send_timeout=1.0) as outsider:
                with pytest.raises(TransportTimeout):  # the handshake never completes: nothing is taken
                    outsider.send(msg)
                    pytest.fail(f"{address} took a message from a peer without the keys")
    finally:
        a_to_b.close()
        b_to_a.close()
        stop_together(a, b)
