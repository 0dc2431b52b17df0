"""Per-layer-group block tables (a full-attention group and a sliding group on one pool): the sliding
group frees a block at the first step whose window no longer reaches it while the full group keeps it,
prefix hits are exact in both groups, allocation is all-or-nothing, a preempted request recomputes from
its cached prefix, and no block leaks. A decode engine's received prompt takes in each group only the blocks
the KV link fills, and each model layer maps to its group's table and cache slot (CacheLayers)."""

from __future__ import annotations

import pytest

from pdserve.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from pdserve.engine.kv_cache_groups import CacheLayers, group_layers_by_window
from pdserve.engine.kv_cache_manager import SKIPPED_BLOCK_ID
from pdserve.kvtransfer.layout import window_start
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, make_request, prefill  # duck-typed: any manager
from tests.engine.test_kv_cache_window import decode_one

WINDOW = 6  # the token at position p sees positions p - 5 .. p
FULL, SLIDING = 0, 1


def make_manager(num_blocks: int = 32) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_blocks, BLOCK_SIZE, True, [None, WINDOW])


def held(manager: HybridKVCacheManager, request, group: int) -> list[bool]:
    return [block is not None for block in manager.groups[group].req_to_blocks[request.request_id]]


def assert_all_free(manager: HybridKVCacheManager) -> None:
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == manager.num_blocks
    assert all(group.req_to_blocks == {} for group in manager.groups)
    manager.check_invariants()


def test_layer_groups_by_window():
    gemma3 = group_layers_by_window([8, 8, 8, 8, 8, None])  # 5 local : 1 global: groups of one layer
    assert gemma3.windows == [None, 8, 8, 8, 8, 8] and gemma3.layers_per_group == 1
    assert gemma3.group_of_layer() == (1, 2, 3, 4, 5, 0) and gemma3.slot_of_layer() == (0,) * 6
    alternating = group_layers_by_window([8, None] * 2)
    assert alternating.windows == [None, 8] and alternating.layers_per_group == 2
    assert alternating.group_of_layer() == (1, 0, 1, 0) and alternating.slot_of_layer() == (0, 0, 1, 1)
    assert group_layers_by_window([7, 7]) is None and group_layers_by_window([None] * 3) is None


def test_the_sliding_group_frees_a_block_at_the_first_step_that_no_longer_sees_it():
    manager = make_manager()
    request = make_request(list(range(100, 120)))  # 20 tokens: blocks 0-4 in each group
    prefill(manager, request)
    request.append_output_token(7)  # position 20
    assert manager.num_used_blocks == 10
    decode_one(manager, request)  # position 20 sees 15..20: sliding blocks 0-2 leave
    assert held(manager, request, FULL) == [True] * 6
    assert held(manager, request, SLIDING) == [False, False, False, True, True, True]
    assert manager.get_block_ids(request.request_id)[SLIDING][:3] == [SKIPPED_BLOCK_ID] * 3
    assert manager.num_used_blocks == 6 + 3
    decode_one(manager, request)  # position 21 sees 16..21: sliding block 3 leaves now, not before
    assert held(manager, request, SLIDING) == [False] * 4 + [True, True]
    assert manager.num_used_blocks == 6 + 2
    manager.check_invariants()
    manager.free(request)
    assert_all_free(manager)


def test_a_prefix_hit_is_exact_in_each_group():
    manager = make_manager()
    first = make_request(list(range(300, 320)))
    prefill(manager, first)
    first.append_output_token(7)
    full_blocks = list(manager.groups[FULL].req_to_blocks[first.request_id][:5])
    sliding_blocks = list(manager.groups[SLIDING].req_to_blocks[first.request_id][:5])
    for _ in range(3):
        decode_one(manager, first)  # the sliding group frees its blocks 0-3 (cached still)
    second = make_request(list(range(300, 320)) + [1, 2, 3])
    hits, num_hit = manager.get_computed_blocks(second)
    # Position 20 sees 15..20: the sliding group needs blocks 3-4 only; the full group every block.
    assert num_hit == 20
    assert hits[FULL] == full_blocks and hits[SLIDING] == [None] * 3 + sliding_blocks[3:]
    assert not set(map(id, full_blocks)) & set(map(id, sliding_blocks))  # each group its own blocks
    assert manager.allocate_slots(second, second.num_tokens - num_hit, num_hit, hits) is not None
    assert held(manager, second, SLIDING) == [False] * 3 + [True] * 3
    assert [b.ref_cnt for b in full_blocks] == [2] * 5 and [b.ref_cnt for b in sliding_blocks] == [0, 0, 0, 1, 2]
    manager.check_invariants()
    manager.free(first)
    manager.free(second)
    assert_all_free(manager)


def test_a_hit_stops_where_any_group_misses_a_block_it_reads():
    manager = make_manager()
    first = make_request(list(range(600, 620)))
    prefill(manager, first)
    manager.free(first)
    full = manager.groups[FULL].req_to_blocks  # emptied by free: the blocks are found by their keys
    full_blocks = [manager.pool.get_cached_block(h + (FULL).to_bytes(2, "big")) for h in first.block_hashes]
    sliding_blocks = [manager.pool.get_cached_block(h + (SLIDING).to_bytes(2, "big")) for h in first.block_hashes]
    assert full == {} and None not in full_blocks + sliding_blocks
    manager.pool.uncache([sliding_blocks[0]])  # outside the window of position 20: the hit keeps 5 blocks
    assert manager.get_computed_blocks(make_request(list(range(600, 620)) + [5]))[1] == 20
    manager.pool.uncache([sliding_blocks[3]])  # inside it: 12 tokens (position 12 sees 7..12, blocks 1-2)
    hits, num_hit = manager.get_computed_blocks(make_request(list(range(600, 620)) + [5]))
    assert num_hit == 12 and hits == (full_blocks[:3], [None] + sliding_blocks[1:3])
    manager.pool.uncache([full_blocks[2]])  # the full group reads every block: at most 8 tokens, but
    hits, num_hit = manager.get_computed_blocks(make_request(list(range(600, 620)) + [5]))
    assert num_hit == 0 and hits == ([], [])  # position 8 (and 4) sees the evicted sliding block 0
    assert_all_free(manager)


def test_allocation_is_all_or_nothing_across_groups():
    manager = make_manager(num_blocks=9)
    request = make_request(list(range(700, 720)))  # needs 5 blocks in each group: 10 > 9
    assert manager.allocate_slots(request, request.num_tokens) is None
    assert_all_free(manager)
    assert manager.allocate_slots(request, 16) is not None  # a chunk of 16: 4 + 4
    assert manager.num_used_blocks == 8
    manager.free(request)
    assert_all_free(manager)


def test_a_preempted_request_recomputes_from_its_cached_prefix():
    manager = make_manager()
    request = make_request(list(range(400, 420)))
    prefill(manager, request)
    request.append_output_token(7)
    for _ in range(4):
        decode_one(manager, request)
    block_ids = manager.get_block_ids(request.request_id)
    manager.free(request)  # preemption: both groups' blocks go back
    assert_all_free(manager)
    request.num_computed_tokens = 0
    hits, num_hit = manager.get_computed_blocks(request)
    assert num_hit == 24  # 25 tokens: every full block but the one holding the last token
    assert [b.block_id for b in hits[FULL]] == block_ids[FULL][:6]
    assert [b is None for b in hits[SLIDING]] == [True] * 4 + [False] * 2  # position 24 sees 19..24
    assert [b.block_id for b in hits[SLIDING][4:]] == block_ids[SLIDING][4:6]
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is not None
    assert held(manager, request, FULL) == [True] * 7
    assert held(manager, request, SLIDING) == [False] * 4 + [True] * 3
    manager.check_invariants()
    manager.free(request)
    assert_all_free(manager)


def test_bad_hits_are_refused_with_a_sentence():
    manager = make_manager()
    request = make_request(list(range(800, 820)))
    with pytest.raises(ValueError, match="layer groups"):
        manager.allocate_slots(request, 4, 4, ([None],))


def test_max_blocks_held_counts_a_window_and_a_chunk_for_a_sliding_group():
    manager = make_manager()
    assert manager.max_blocks_held(400, 16) == 100 + (6 + 16 + 3) // 4 + 1
    assert manager.max_blocks_held(8, 16) == 2 + 2


def test_a_free_hit_of_one_group_is_never_handed_to_another_as_a_new_block():
    """Every group's hits leave the free queue before any group takes new blocks: here group 0's five new
    blocks would otherwise reach group 1's hit, queued right behind group 0's own blocks."""
    manager = make_manager(num_blocks=12)
    shared = make_request(list(range(900, 908)))  # 2 blocks a group, freed first: queued first
    other = make_request(list(range(950, 966)))  # 4 blocks a group
    prefill(manager, shared)
    prefill(manager, other)
    manager.free(shared)
    manager.free(other)
    request = make_request(list(range(900, 904)) + list(range(10, 27)))  # 21 tokens: 1 hit + 5 new a group
    hits, num_hit = manager.get_computed_blocks(request)
    assert num_hit == 4
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is not None
    assert manager.num_free_blocks == 0
    manager.check_invariants()
    full_ids, sliding_ids = manager.get_block_ids(request.request_id)
    assert not set(full_ids) & set(sliding_ids)
    assert full_ids[0] == hits[FULL][0].block_id and sliding_ids[0] == hits[SLIDING][0].block_id
    manager.free(request)
    assert_all_free(manager)


def receive(manager: HybridKVCacheManager, request) -> int:
    """What a decode engine does for a prompt whose KV comes over the KV link: its own hit, then blocks for the
    rest as external tokens, published only once the KV has landed. Returns the hit tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    num_external = request.num_tokens - num_hit
    assert manager.allocate_slots(request, 0, num_hit, hits, num_external_computed_tokens=num_external,
                                  delay_cache_blocks=True) is not None
    request.num_computed_tokens = num_hit
    request.num_external_computed_tokens = num_external
    return num_hit


def test_a_received_prompt_takes_only_the_blocks_its_layers_receive():
    """A decode engine's sliding group allocates from the first block the link sends a sliding layer
    (kvtransfer.layout.window_start), the full group every block; blocks published once the KV landed are hits
    for another prompt only where every group holds them; decoding frees what leaves the window; nothing leaks."""
    manager = make_manager()
    prompt = list(range(1000, 1018))  # 18 tokens: position 18 sees 13..18, the link sends a sliding layer 12..17
    request = make_request(prompt)
    assert receive(manager, request) == 0
    first_sent_block = window_start(len(prompt), WINDOW, BLOCK_SIZE) // BLOCK_SIZE
    assert first_sent_block == 3
    assert held(manager, request, FULL) == [True] * 5
    assert held(manager, request, SLIDING) == [False] * first_sent_block + [True] * 2
    same_start = make_request(prompt[:12] + [5, 5, 5, 5, 5])
    assert manager.get_computed_blocks(same_start)[1] == 0, "nothing is published before the KV lands"
    request.num_computed_tokens = len(prompt)  # the KV landed (scheduler: _on_remote_kv_received)
    manager.cache_blocks(request, len(prompt))
    # a hit of 3 blocks needs the sliding block 1 (position 12 sees 7..12), never allocated here: none
    assert manager.get_computed_blocks(same_start)[1] == 0
    # a hit of 4 blocks needs sliding blocks 2 and 3: block 2 was never allocated either
    assert manager.get_computed_blocks(make_request(prompt[:16] + [5]))[1] == 0
    request.append_output_token(7)
    for _ in range(6):  # positions 18..23: the window moves past block 3
        decode_one(manager, request)
    assert held(manager, request, FULL) == [True] * 6
    assert held(manager, request, SLIDING) == [False] * 4 + [True] * 2
    manager.check_invariants()
    manager.free(request)
    assert_all_free(manager)


def test_a_received_prompt_after_a_prefix_hit_takes_the_rest():
    """A decode engine's own hit (every group holds the blocks the hit's first new token reads), then the rest of
    the prompt from the link; a failed transfer frees every group's blocks, hits included."""
    manager = make_manager()
    first = make_request(list(range(1100, 1120)))
    prefill(manager, first)  # computed here: every block it holds is published
    manager.free(first)
    second = make_request(list(range(1100, 1120)) + list(range(50, 58)))  # 28 tokens
    num_hit = receive(manager, second)
    assert num_hit == 20
    assert held(manager, second, FULL) == [True] * 7
    # position 28 sees 23..28: the sliding group holds blocks 5 and 6 only, from the link
    assert held(manager, second, SLIDING) == [False] * 5 + [True] * 2
    manager.free(second)  # the transfer failed: recompute from scratch
    assert_all_free(manager)


def test_cache_layers_map_each_model_layer_to_its_slot_and_table():
    gemma3 = group_layers_by_window([8] * 5 + [None] + [8] * 5 + [None])  # groups of two layers
    layers = CacheLayers.of_cache(gemma3.layers_per_group, gemma3)
    assert layers.num_layers == 12 and layers.num_tables == 6
    runs = [(run.layer_start, run.layer_end, run.group, run.slot) for run in layers.runs(3, 8)]
    assert runs == [(3, 4, 2, 1), (4, 5, 3, 0), (5, 6, 0, 0), (6, 7, 3, 1), (7, 8, 4, 0)]
    with pytest.raises(ValueError, match="2 block tables for a cache of 6"):
        layers.tables(([1], [2]))
    one_table = CacheLayers.of_cache(4, None)
    assert [(run.layer_start, run.layer_end, run.group, run.slot) for run in one_table.runs(1, 4)] == [(1, 4, 0, 1)]
    assert one_table.tables([3, 1]) == ([3, 1],)
