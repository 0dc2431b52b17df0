"""Which prompt tokens of which layers cross the KV link (kvtransfer/layout.py), and per-layer windows in the
layout fingerprint: a pair whose windows differ is refused naming each differing layer."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.control.errors import ProtocolError
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, SamplingParams
from pdserve.kvtransfer.errors import LayoutMismatchError
from pdserve.kvtransfer.fingerprint import LayoutFingerprint, check_compatible, for_cache
from pdserve.kvtransfer.layout import LayerSpan, LinkLayout, format_windows, parse_windows, window_start

GEMMA3 = (8, 8, 8, 8, 8, None)  # 5 local : 1 global
FINGERPRINT = LayoutFingerprint(architecture="Gemma3ForCausalLM", num_layers=6, num_kv_heads=2, head_dim=16,
                                dtype="float32", block_size=4, weights_hash="w", layer_windows=format_windows(GEMMA3))


def test_a_sliding_layer_starts_at_the_block_its_window_reaches_from_the_first_decoded_token():
    layout = LinkLayout(GEMMA3, block_size=4)
    # position 32 sees 25..32: the block of 24..27 on; the full layer sends everything asked
    assert layout.first_positions(32, 0) == (24,) * 5 + (0,)
    assert layout.first_positions(32, 28) == (28,) * 5 + (28,)  # a prefix hit past the window start
    assert layout.first_positions(5, 0) == (0,) * 6  # a prompt shorter than the window: everything
    assert LinkLayout.num_tokens_per_layer(layout.first_positions(32, 0), 32) == [8] * 5 + [32]


def test_the_window_start_is_the_one_the_kv_cache_manager_frees_by():
    """Both engines keep exactly the blocks the decode engine reads: what the link sends is what a colocated
    engine keeps at the first decode step."""
    for prompt_len in range(1, 40):
        manager = KVCacheManager(32, block_size=4, sliding_window=8)
        request = Request("r", list(range(prompt_len)), SamplingParams(temperature=0.0))
        assert manager.allocate_slots(request, prompt_len) is not None
        request.num_computed_tokens = prompt_len
        request.append_output_token(1)
        assert manager.allocate_slots(request, 1) is not None
        kept = [i for i, block in enumerate(manager.req_to_blocks["r"]) if block is not None]
        assert kept[0] * 4 == window_start(prompt_len, 8, 4), f"prompt of {prompt_len}"


def test_spans_group_neighbouring_layers_that_carry_the_same_tokens():
    firsts = (0, 20, 20, 0)
    assert list(LinkLayout.spans(firsts, 0, 4, 0, 30)) == [
        LayerSpan(0, 1, 0, 30), LayerSpan(1, 3, 20, 30), LayerSpan(3, 4, 0, 30)]
    assert list(LinkLayout.spans(firsts, 1, 3, 0, 16)) == []  # a chunk before the window: nothing
    assert list(LinkLayout.spans(firsts, 0, 4, 24, 30)) == [LayerSpan(0, 4, 24, 30)]  # one message for all
    assert list(LinkLayout.spans(firsts, 2, 2, 0, 30)) == []


def test_windows_are_written_as_runs_and_read_back():
    assert format_windows(GEMMA3) == "8*5,full"
    assert parse_windows("8*5,full") == GEMMA3
    assert parse_windows(format_windows((None,) * 61)) == (None,) * 61
    for bad in ("8*0", "sliding", "-3", "full*", "8**2", "full*100000000"):
        with pytest.raises(ValueError):
            parse_windows(bad)


def test_a_pair_whose_windows_differ_is_refused_naming_each_differing_layer():
    mistral_like = dataclasses.replace(FINGERPRINT, layer_windows="8*6")
    assert FINGERPRINT.diff(mistral_like) == ["layer_windows differ at layers 5: local 5=full, remote 5=8"]
    with pytest.raises(LayoutMismatchError) as info:
        check_compatible(FINGERPRINT, dataclasses.replace(FINGERPRINT, layer_windows="full,8*5"))
    assert "layer_windows differ at layers 0, 5: local 0=8 5=full, remote 0=full 5=8" in str(info.value)
    assert "attention windows" in str(info.value)


def test_a_peer_fingerprint_with_bad_windows_is_a_protocol_error():
    data = FINGERPRINT.to_dict()
    for windows, words in (("8*5", "describes 5 layers, not 6"), ("8*5,half", "'half'")):
        with pytest.raises(ProtocolError, match=words):
            LayoutFingerprint.from_dict({**data, "layer_windows": windows})
    assert LayoutFingerprint.from_dict(data) == FINGERPRINT
    assert LayoutFingerprint.from_dict({**data, "layer_windows": "8,8,8,8,8,full"}) == FINGERPRINT  # one spelling


def test_the_cache_decides_planes_and_per_token_shape():
    """A latent (MLA) cache [layers, 1, blocks, block_size, 1, width] differs from any K/V layout."""
    plain = dataclasses.replace(FINGERPRINT, layer_windows="")
    assert plain.layer_windows == "full*6" and plain.kv_planes == 2
    latent = for_cache(plain, (6, 1, 10, 4, 1, 576))
    assert (latent.kv_planes, latent.num_kv_heads, latent.head_dim) == (1, 1, 576)
    assert any(line.startswith("kv_planes: local=2 remote=1") for line in plain.diff(latent))
    assert for_cache(plain, (6, 2, 10, 4, 2, 16)) == plain
    with pytest.raises(ValueError, match="6 layers in blocks of 4"):
        for_cache(plain, (6, 2, 10, 16, 2, 16))
