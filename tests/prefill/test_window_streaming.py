"""What a prefill engine sends of sliding-window layers, message by message (real ServerSocket/ClientSocket; the
engine is stood in for by a hand-made KV cache and plans): a sliding layer's KV goes from the first block its
window reaches at the handoff, a full layer's from the first asked token, streamed per layer or from the cache,
and each message holds exactly the cache's bytes for its layers and tokens. Each test runs on a cache with one
block table for every layer and on one with a table per layer group (a sliding group's blocks before its window
freed: never read)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.engine.kv_cache_groups import group_layers_by_window
from pdserve.engine.kv_cache_manager import SKIPPED_BLOCK_ID
from pdserve.kvtransfer.fingerprint import LayoutFingerprint
from pdserve.kvtransfer.layout import format_windows
from pdserve.kvtransfer.messages import Hello, HelloAck, KVDone, KVWant
from pdserve.prefill.transfer_side import PrefillTransferSide
from pdserve.prefill.transfers import Transfer
from tests.prefill.test_layer_streaming import _layers_received, _wait_until

WINDOWS = (4, 4, None, 4)  # layer 2 attends to everything
NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 12, 4, 2, 8
PROMPT_LEN, BLOCK_IDS = 14, [5, 2, 7, 1]  # position 14 sees 11..14: sliding layers send from token 8 (block 2)
GROUPS = group_layers_by_window(WINDOWS)  # 4 groups of one layer: the full layer 2 first, then layers 0, 1, 3
SKIP = SKIPPED_BLOCK_ID
GROUP_BLOCK_IDS = ([5, 2, 7, 1], [SKIP, SKIP, 3, 4], [SKIP, SKIP, 6, 8], [SKIP, SKIP, 9, 10])


@dataclass
class Link:
    side: PrefillTransferSide
    client: ClientSocket
    kv_cache: torch.Tensor  # [layer slots, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM]
    block_ids: list[int] | tuple[list[int], ...]  # the request's, as its KV cache manager gives them

    def layer_kv(self, layer: int, start: int, end: int) -> torch.Tensor:  # [2, T, H, D] of one model layer
        if isinstance(self.block_ids, list):
            slot, table = layer, self.block_ids
        else:
            slot, table = GROUPS.slot_of_layer()[layer], self.block_ids[GROUPS.group_of_layer()[layer]]
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)])
        return self.kv_cache[slot].flatten(1, 2).index_select(1, slots)


@pytest.fixture(params=["one table", "layer groups"])
def link(request):
    fingerprint = LayoutFingerprint(architecture="Gemma3ForCausalLM", num_layers=len(WINDOWS), num_kv_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, dtype="float32", block_size=BLOCK_SIZE, weights_hash="w",
                                    layer_windows=format_windows(WINDOWS))
    side = PrefillTransferSide(ServerSocket("tcp://127.0.0.1:0"), fingerprint, stream_layers=True)
    grouped = request.param == "layer groups"
    side.bind_kv_groups(GROUPS if grouped else None)
    slots = GROUPS.layers_per_group if grouped else len(WINDOWS)
    kv_cache = torch.randn(slots, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    side.bind_kv_cache(kv_cache)
    client = ClientSocket(side.server.address)
    client.send(Hello(fingerprint=fingerprint.to_dict(), role="decode", engine_id="d0"))
    _wait_until(lambda: side.receive() or client.socket.poll(0))
    assert isinstance(client.recv(timeout=5).msg, HelloAck)
    yield Link(side, client, kv_cache, GROUP_BLOCK_IDS if grouped else BLOCK_IDS)
    client.close()
    side.close()


def _cache_kv(link: Link, layer_start, layer_end, start, end) -> torch.Tensor:  # [layers, 2, T, H, D]
    return torch.stack([link.layer_kv(layer, start, end) for layer in range(layer_start, layer_end)])


def _step(link: Link, computed: int, new: int) -> None:
    """One model step computing prompt tokens [computed, computed + new); each layer stores, then the hook."""
    side = link.side
    request = SimpleNamespace(request_id="r", num_computed_tokens=computed, num_prompt_tokens=PROMPT_LEN)
    hook = side.layer_hook(SimpleNamespace(scheduled=[SimpleNamespace(request=request, block_ids=link.block_ids,
                                                                      num_new_tokens=new)]))
    for layer in range(len(WINDOWS) if hook is not None else 0):
        hook(layer)


def _ranges(received) -> list[tuple[int, int, int, int]]:
    return [(m.layer_start, m.layer_end, m.token_start, m.num_tokens) for m, _ in received]


def _assert_bytes_are_the_cache(received, link: Link) -> None:
    for msg, kv in received:
        start = msg.token_start
        torch.testing.assert_close(kv, _cache_kv(link, msg.layer_start, msg.layer_end, start,
                                                 start + msg.num_tokens), rtol=0, atol=0)


def test_streamed_chunks_send_sliding_layers_only_from_their_window(link):
    side, client = link.side, link.client
    client.send(KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or "r" in side.transfers)
    _step(link, 0, 8)  # before the window: only the full layer has something to send
    _step(link, 8, 6)
    received = _layers_received(client, 5)
    assert _ranges(received) == [(2, 3, 0, 8), (0, 1, 8, 6), (1, 2, 8, 6), (2, 3, 8, 6), (3, 4, 8, 6)]
    _assert_bytes_are_the_cache(received, link)
    assert side.transfers["r"].sent_upto == PROMPT_LEN


def test_a_want_after_the_first_chunk_catches_up_only_the_full_layer(link):
    side, client = link.side, link.client
    _step(link, 0, 8)  # nobody asked yet
    client.send(KVWant(request_id="r", skip_tokens=0, num_tokens=PROMPT_LEN))
    _wait_until(lambda: side.receive() or "r" in side.transfers)
    _step(link, 8, 6)
    received = _layers_received(client, 5)
    assert _ranges(received) == [(2, 3, 0, 8), (0, 1, 8, 6), (1, 2, 8, 6), (2, 3, 8, 6), (3, 4, 8, 6)]
    _assert_bytes_are_the_cache(received, link)


@pytest.mark.parametrize("skip", [0, 12])
def test_a_computed_prompt_goes_from_the_cache_in_one_message_per_run_of_layers(link, skip):
    """Streaming off (or a KVWant after the prompt): runs of layers with the same first token share a message; a
    decode engine's prefix hit past the window's start is where every layer starts."""
    side, client = link.side, link.client
    side.stream_layers = False
    request = SimpleNamespace(request_id="r", num_prompt_tokens=PROMPT_LEN, output_token_ids=[3], logprobs=None)
    side.transfers["r"] = Transfer.computed(request, link.block_ids)
    client.send(KVWant(request_id="r", skip_tokens=skip, num_tokens=PROMPT_LEN - skip))
    _wait_until(lambda: side.receive() or client.socket.poll(0))
    # (layers, first prompt position, tokens)
    expected = [(0, 2, 8, 6), (2, 3, 0, 14), (3, 4, 8, 6)] if skip == 0 else [(0, 4, 12, 2)]
    received = _layers_received(client, len(expected))
    assert _ranges(received) == [(a, b, start - skip, n) for a, b, start, n in expected]
    for msg, kv in received:
        start = skip + msg.token_start
        torch.testing.assert_close(kv, _cache_kv(link, msg.layer_start, msg.layer_end, start,
                                                 start + msg.num_tokens), rtol=0, atol=0)
    assert isinstance(client.recv(timeout=5).msg, KVDone)
