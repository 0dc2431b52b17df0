"""The decode engine takes of a sliding-window layer only the tokens of its window at the handoff: a KVLayer that
holds earlier tokens of such a layer is refused before anything is written, and a request whose layers did not
each get exactly their tokens fails at KVDone, naming the layer. With a block table per layer group, each layer's
KV goes into its group's blocks at its slot."""

from __future__ import annotations

import torch

from pdserve.decode.incoming import IncomingTransfer
from pdserve.decode.kv_writer import KVWriter
from pdserve.decode.transfer_side import _short_diff
from pdserve.engine.kv_cache_groups import CacheLayers, group_layers_by_window
from pdserve.engine.kv_cache_manager import SKIPPED_BLOCK_ID
from pdserve.kvtransfer.layout import LinkLayout
from pdserve.kvtransfer.messages import KVLayer

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 8, 4, 2, 8
LAYOUT = LinkLayout((4, None), BLOCK_SIZE)  # layer 0 slides (window 4), layer 1 is full
PROMPT_LEN = 14  # position 14 sees 11..14: layer 0 carries tokens from 8 on


class _Request:
    request_id = "r"


def _incoming() -> IncomingTransfer:
    incoming = IncomingTransfer(_Request(), (torch.tensor([5, 2, 7, 1]),), 0, PROMPT_LEN, address="tcp://127.0.0.1:1")
    incoming.first_positions = LAYOUT.first_positions(PROMPT_LEN, 0)
    return incoming


def _message(layer_start: int, layer_end: int, start: int, end: int) -> tuple[KVLayer, torch.Tensor]:
    kv = torch.randn(layer_end - layer_start, 2, end - start, KV_HEADS, HEAD_DIM)
    msg, _ = KVLayer.from_tensor(kv, request_id="r", layer_start=layer_start, token_start=start)
    return msg, kv


def test_a_sliding_layers_tokens_before_its_window_are_refused_untouched():
    kv_cache = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    writer, incoming = KVWriter(kv_cache), _incoming()
    assert incoming.first_positions == (8, 0)
    early, _ = _message(0, 2, 4, 14)
    assert writer.layer_problem(incoming, early) == (
        "KV of layer 0 from prompt position 4, before 8 where its sliding window starts: that layer carries only "
        "its window")
    assert not kv_cache.any()
    for layer_start, layer_end, start in ((0, 1, 8), (1, 2, 0)):
        msg, kv = _message(layer_start, layer_end, start, PROMPT_LEN)
        assert writer.layer_problem(incoming, msg) is None
        writer.write(incoming, msg, kv)
    block_of = [5, 2, 7, 1]
    for position in range(PROMPT_LEN):
        block, offset = block_of[position // BLOCK_SIZE], position % BLOCK_SIZE
        assert kv_cache[1, :, block, offset].any()  # the full layer: every token
        assert kv_cache[0, :, block, offset].any() == (position >= 8)  # the sliding layer: its window only


def test_a_layer_short_of_its_tokens_is_named():
    expected = LinkLayout.num_tokens_per_layer((8, 0), PROMPT_LEN)
    assert expected == [6, 14]
    assert _short_diff([6, 10], expected) == "layer 1: 10 of 14 tokens arrived"
    assert _short_diff([14, 14], expected) == "layer 0: 14 of 6 tokens arrived"


def test_each_layer_goes_into_its_groups_blocks():
    """Layers 0 and 1 in two groups of one layer each (the full layer 1 first): one cache slot, a table each; the
    sliding group holds only its window's blocks (its first two entries were never allocated)."""
    groups = group_layers_by_window(LAYOUT.windows)
    assert [group.layer_ids for group in groups.groups] == [(1,), (0,)]
    kv_cache = torch.zeros(1, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    writer = KVWriter(kv_cache, CacheLayers(NUM_LAYERS, groups))
    full_blocks, sliding_blocks = [5, 2, 7, 1], [SKIPPED_BLOCK_ID, SKIPPED_BLOCK_ID, 3, 6]
    incoming = _incoming()
    incoming.block_ids = (torch.tensor(full_blocks), torch.tensor(sliding_blocks))
    sent = {}
    for layer_start, layer_end, start in ((0, 1, 8), (1, 2, 0), (0, 2, 13)):  # the last: both layers, mid-block
        msg, kv = _message(layer_start, layer_end, start, PROMPT_LEN)
        assert writer.layer_problem(incoming, msg) is None
        writer.write(incoming, msg, kv)
        for layer in range(layer_start, layer_end):
            for offset, position in enumerate(range(start, PROMPT_LEN)):
                sent[layer, position] = kv[layer - layer_start, :, offset]
    for layer, table in ((1, full_blocks), (0, sliding_blocks)):
        for position in range(PROMPT_LEN):
            block, offset = table[position // BLOCK_SIZE], position % BLOCK_SIZE
            if (layer, position) in sent:
                torch.testing.assert_close(kv_cache[0, :, block, offset], sent[layer, position], rtol=0, atol=0)
    written = {(table[p // BLOCK_SIZE], p % BLOCK_SIZE) for layer, table in ((1, full_blocks), (0, sliding_blocks))
               for p in range(PROMPT_LEN) if (layer, p) in sent}
    untouched = [(b, o) for b in range(NUM_BLOCKS) for o in range(BLOCK_SIZE) if (b, o) not in written]
    assert all(not kv_cache[0, :, b, o].any() for b, o in untouched), "nothing outside the layers' blocks is written"
