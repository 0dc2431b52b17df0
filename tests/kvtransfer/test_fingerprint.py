"""Layout fingerprint: differences are named field by field; the weights hash is stable and cheap."""

from __future__ import annotations

import builtins
import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pdserve.control.errors import ProtocolError
from pdserve.control.protocol import decode, encode
from pdserve.kvtransfer import fingerprint as fp
from pdserve.kvtransfer.errors import LayoutMismatchError, WeightsHashError
from pdserve.kvtransfer.fingerprint import (
    LayoutFingerprint,
    check_compatible,
    hash_weights_file,
)
from pdserve.kvtransfer.messages import Hello

DROP = object()
LOCAL = LayoutFingerprint(architecture="LlamaForCausalLM", num_layers=4, num_kv_heads=2, head_dim=16,
                          dtype="bfloat16", block_size=16, weights_hash="0123abcd")


def test_dict_round_trip_through_a_hello_message():
    hello = Hello(fingerprint=LOCAL.to_dict(), role="decode", engine_id="d0")
    received, _ = decode([bytes(p) for p in encode(hello)])
    assert LayoutFingerprint.from_dict(received.fingerprint) == LOCAL


def test_identical_layouts_are_compatible():
    check_compatible(LOCAL, dataclasses.replace(LOCAL))
    assert LOCAL.diff(LOCAL) == []


def test_mismatch_names_each_field_with_both_values():
    remote = dataclasses.replace(LOCAL, num_kv_heads=8, dtype="float16")
    assert LOCAL.diff(remote) == ["num_kv_heads: local=2 remote=8", "dtype: local='bfloat16' remote='float16'"]
    with pytest.raises(LayoutMismatchError) as info:
        check_compatible(LOCAL, remote)
    message = str(info.value)
    assert "num_kv_heads: local=2 remote=8" in message and "dtype: local='bfloat16' remote='float16'" in message
    assert "same model weights" in message
    assert info.value.differences == LOCAL.diff(remote)
    assert "weights_hash" in LOCAL.diff(dataclasses.replace(LOCAL, weights_hash="ffff"))[0]


@pytest.mark.parametrize("change, words", [
    ({"num_layers": DROP}, ["missing", "num_layers"]),
    ({"rope_theta": 10000}, ["unexpected", "rope_theta"]),
    ({"num_layers": "4"}, ["fingerprint.num_layers", "expected int"]),
    ({"head_dim": 0}, ["fingerprint.head_dim=0", "positive"]),
    ({"dtype": 2}, ["fingerprint.dtype", "expected str"]),
])
def test_bad_peer_dict_is_a_protocol_error(change, words):
    data = {k: v for k, v in {**LOCAL.to_dict(), **change}.items() if v is not DROP}
    with pytest.raises(ProtocolError) as info:
        LayoutFingerprint.from_dict(data)
    for word in words:
        assert word in str(info.value)


# ---- weights hash ----

def write_model(directory, seed: int = 0, shards: int = 2) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for shard in range(shards):
        tensors = {f"layers.{shard}.weight": torch.randn(16, 16, generator=generator)}
        save_file(tensors, directory / f"model-{shard:05d}-of-{shards:05d}.safetensors")


def test_hash_is_stable_and_follows_content(tmp_path):
    write_model(tmp_path / "a", seed=0)
    write_model(tmp_path / "b", seed=0)
    write_model(tmp_path / "c", seed=1)
    first = hash_weights_file(tmp_path / "a")
    assert first == hash_weights_file(str(tmp_path / "a")) == hash_weights_file(tmp_path / "b")
    assert first != hash_weights_file(tmp_path / "c")
    assert len(first) == 32 and int(first, 16) >= 0
    single = tmp_path / "a" / "model-00000-of-00002.safetensors"
    assert hash_weights_file(single) != first


def test_hash_ignores_file_names_but_not_shard_order(tmp_path):
    write_model(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "renamed")
    for index, path in enumerate(sorted((tmp_path / "renamed").glob("*.safetensors"))):
        path.rename(path.with_name(f"part{index}.safetensors"))
    assert hash_weights_file(tmp_path / "renamed") == hash_weights_file(tmp_path / "a")


def test_one_changed_weight_changes_the_hash_of_a_small_file(tmp_path):
    write_model(tmp_path / "a", shards=1)
    path = next((tmp_path / "a").glob("*.safetensors"))
    before = hash_weights_file(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert hash_weights_file(path) != before


def big_file(path, data_bytes: int) -> None:
    """A valid safetensors file whose data section is data_bytes long but sparse on disk."""
    save_file({"w": torch.zeros(4, dtype=torch.uint8)}, path)
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size - 4 + data_bytes)


def test_big_files_are_sampled_not_read(tmp_path, monkeypatch):
    path = tmp_path / "big.safetensors"
    big_file(path, 1 << 30)  # 1 GiB, sparse
    num_bytes_read = 0
    real_open = builtins.open

    class CountingFile:
        def __init__(self, file):
            self.file = file

        def read(self, size=-1):
            nonlocal num_bytes_read
            chunk = self.file.read(size)
            num_bytes_read += len(chunk)
            return chunk

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(fp, "open", lambda *a, **k: CountingFile(real_open(*a, **k)), raising=False)
    before = hash_weights_file(path)
    assert num_bytes_read <= fp.SAMPLES_PER_FILE * fp.SAMPLE_BYTES + 4096
    with real_open(path, "r+b") as file:  # the very last byte is inside the last sample
        file.seek(-1, 2)
        file.write(b"\x01")
    assert hash_weights_file(path) != before


def test_missing_or_broken_weights_are_named(tmp_path):
    with pytest.raises(WeightsHashError, match=f"no \\*.safetensors weights at {tmp_path}"):
        hash_weights_file(tmp_path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(WeightsHashError, match="not a safetensors file"):
        hash_weights_file(tmp_path)
    bad.write_bytes(b"\x01")
    with pytest.raises(WeightsHashError, match="not a safetensors file"):
        hash_weights_file(bad)
