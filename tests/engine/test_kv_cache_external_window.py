"""KV received from a prefill engine holds, for sliding-window layers, only the blocks the first decoded token's
window reaches: the decode engine's manager publishes the request's blocks from there on, so no prefix hit ever
reads a block that lacks a layer's KV; with every layer sliding, the blocks before the window are freed at the
first decode step, as on a colocated engine."""

from __future__ import annotations

from pdserve.engine.kv_cache_manager import SKIPPED_BLOCK_ID, KVCacheManager
from pdserve.kvtransfer.layout import window_start
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, assert_all_blocks_free, make_request

WINDOW = 6


def receive(manager: KVCacheManager, request) -> None:
    """Allocate like a decode engine for remote KV, then the KV lands (as the scheduler does)."""
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    num_external = request.num_tokens - num_hit
    assert manager.allocate_slots(request, 0, num_hit, hit_blocks, num_external_computed_tokens=num_external,
                                  delay_cache_blocks=True) is not None
    request.num_external_computed_tokens = num_external
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def published(manager: KVCacheManager, request) -> list[bool]:
    return [manager.pool.get_cached_block(block_hash) is not None for block_hash in request.block_hashes]


def test_only_blocks_from_the_window_on_are_published_on_a_hybrid_model():
    """Some layers full, some sliding (no freeing): blocks before the smallest window stay unpublished."""
    manager = KVCacheManager(32, block_size=BLOCK_SIZE, external_kv_window=WINDOW)
    request = make_request(list(range(100, 124)))  # 24 tokens: 6 full blocks; position 24 sees 19..24
    receive(manager, request)
    first_block = window_start(24, WINDOW, BLOCK_SIZE) // BLOCK_SIZE
    assert first_block == 4
    assert published(manager, request) == [False] * 4 + [True] * 2
    assert manager.get_computed_blocks(make_request(list(range(100, 124)) + [1]))[1] == 0  # the chain starts unpublished
    manager.free(request)
    assert_all_blocks_free(manager)


def test_locally_computed_and_colocated_blocks_are_all_published():
    manager = KVCacheManager(32, block_size=BLOCK_SIZE, external_kv_window=WINDOW)
    request = make_request(list(range(100, 124)))
    hit_blocks, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens, num_hit, hit_blocks) is not None
    assert published(manager, request) == [True] * 6
    manager.free(request)
    assert_all_blocks_free(manager)


def test_every_layer_sliding_allocates_only_the_window_for_received_kv():
    """The blocks before the first decoded token's window are never allocated: nothing writes or reads them."""
    manager = KVCacheManager(32, block_size=BLOCK_SIZE, sliding_window=WINDOW, external_kv_window=WINDOW)
    request = make_request(list(range(200, 224)))  # 24 tokens: position 24 sees 19..24, from block 4 on
    receive(manager, request)
    assert [block is not None for block in manager.req_to_blocks[request.request_id]] == [False] * 4 + [True] * 2
    assert manager.get_block_ids(request.request_id)[:4] == [SKIPPED_BLOCK_ID] * 4
    assert published(manager, request) == [False] * 4 + [True] * 2
    assert manager.num_used_blocks == 2
    request.append_output_token(7)
    assert manager.allocate_slots(request, 1) is not None
    assert [block is not None for block in manager.req_to_blocks[request.request_id]] == [False] * 4 + [True] * 3
    assert manager.num_used_blocks == 3
    manager.check_invariants()
    # A prompt sharing the window's blocks hits them; the blocks before are not needed.
    again = make_request(list(range(200, 224)) + [7, 8, 9])
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 24 and hits[4] is manager.req_to_blocks[request.request_id][4]
    # One that would need an unpublished block (a hit at 20 needs block 3) gets none.
    assert manager.get_computed_blocks(make_request(list(range(200, 220)) + [1, 2, 3]))[1] == 0
    manager.free(request)
    assert_all_blocks_free(manager)


def test_a_received_prompt_longer_than_the_pool_holds_only_its_window():
    manager = KVCacheManager(4, block_size=BLOCK_SIZE, sliding_window=WINDOW, external_kv_window=WINDOW)
    request = make_request(list(range(300, 340)))  # 40 tokens: 10 blocks' worth, in a pool of 4
    receive(manager, request)
    assert manager.num_used_blocks == 2  # blocks 8 and 9: positions 32..39, the window of position 40
    for token in range(3):
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    assert manager.num_used_blocks <= 3
    manager.check_invariants()
    manager.free(request)
    assert_all_blocks_free(manager)
