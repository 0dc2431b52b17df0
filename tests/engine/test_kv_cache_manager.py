"""KVCacheManager scenarios; each ends with assert_all_blocks_free (the leak check)."""

from __future__ import annotations

import itertools

import pytest

from pdserve.engine.block_pool import KVCacheInvariantError
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, SamplingParams

BLOCK_SIZE = 4
_request_ids = itertools.count()


def make_request(token_ids: list[int], request_id: str | None = None) -> Request:
    request_id = request_id if request_id is not None else f"req-{next(_request_ids)}"
    return Request(request_id, list(token_ids), SamplingParams(temperature=0.0))


def make_manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=caching)


def assert_all_blocks_free(manager: KVCacheManager) -> None:
    assert manager.num_used_blocks == 0
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.req_to_blocks == {}
    manager.check_invariants()


def prefill(manager: KVCacheManager, request: Request) -> int:
    """Schedule the whole prompt in one step, like the scheduler would; returns the hit tokens."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hit_blocks
    )
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
        dict(manager.num_cached_blocks),
    )


# -- prefix sharing -----------------------------------------------------------------------------


def test_two_requests_share_a_cached_prefix_with_ref_counts():
    manager = make_manager()
    first = make_request(list(range(10)))  # 2 full blocks + 2 tokens
    assert prefill(manager, first) == 0
    assert manager.get_block_ids(first.request_id) == [0, 1, 2]
    assert manager.pool.num_cached_blocks == 2

    second = make_request(list(range(8)) + [100, 101, 102])
    assert prefill(manager, second) == 8
    shared = manager.req_to_blocks[first.request_id][:2]
    assert manager.req_to_blocks[second.request_id][:2] == shared
    assert manager.get_block_ids(second.request_id) == [0, 1, 3]
    assert [b.ref_cnt for b in shared] == [2, 2]
    assert manager.num_used_blocks == 4
    manager.check_invariants()

    manager.free(first)
    assert [b.ref_cnt for b in shared] == [1, 1]
    assert manager.num_used_blocks == 3
    manager.check_invariants()
    manager.free(second)
    assert_all_blocks_free(manager)


def test_hits_stop_before_the_last_token():
    manager = make_manager()
    tokens = list(range(8))  # exactly 2 blocks
    owner = make_request(tokens)
    prefill(manager, owner)
    manager.free(owner)

    same = make_request(tokens)
    blocks, num_hit_tokens = manager.get_computed_blocks(same)
    assert num_hit_tokens == 4 and len(blocks) == 1  # the last token must still be computed
    longer = make_request(tokens + [8])
    blocks, num_hit_tokens = manager.get_computed_blocks(longer)
    assert num_hit_tokens == 8 and len(blocks) == 2
    assert all(b.ref_cnt == 0 for b in blocks)  # lookups take no references

    assert_all_blocks_free(manager)


def test_prefix_caching_disabled_finds_nothing():
    manager = make_manager(caching=False)
    tokens = list(range(12))
    prefill(manager, make_request(tokens, "a"))
    assert manager.get_computed_blocks(make_request(tokens)) == ([], 0)
    assert manager.pool.num_cached_blocks == 0
    manager.free(make_request([], "a"))
    assert_all_blocks_free(manager)


# -- eviction -----------------------------------------------------------------------------------


def test_least_recently_freed_cached_block_is_evicted_first_tail_before_head():
    manager = make_manager(num_blocks=6)
    first = make_request(list(range(8)))  # blocks 0, 1 (both full, published)
    second = make_request(list(range(100, 108)))  # blocks 2, 3
    prefill(manager, first)
    prefill(manager, second)
    manager.free(first)
    manager.free(second)
    assert manager.pool.free_block_ids() == [4, 5, 1, 0, 3, 2]

    newcomer = make_request(list(range(200, 212)))  # needs 3 blocks
    prefill(manager, newcomer)
    assert manager.get_block_ids(newcomer.request_id) == [4, 5, 1]  # first's tail block evicted
    again = make_request(list(range(8)) + [9])
    blocks, num_hit_tokens = manager.get_computed_blocks(again)
    assert [b.block_id for b in blocks] == [0] and num_hit_tokens == 4  # its head survived
    manager.free(newcomer)
    assert_all_blocks_free(manager)


# -- allocation failure -------------------------------------------------------------------------


def test_allocation_failure_returns_none_and_changes_nothing():
    manager = make_manager(num_blocks=4)
    owner = make_request(list(range(8)))
    prefill(manager, owner)
    manager.free(owner)  # blocks 0, 1 are free but cached

    # 20 tokens: 2 cached blocks + 3 new = 5 > 4 blocks; touching the 2 free hits leaves only 2.
    request = make_request(list(range(8)) + list(range(50, 62)))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 8
    before = snapshot(manager)
    assert manager.allocate_slots(request, 12, num_hit_tokens, hit_blocks) is None
    assert snapshot(manager) == before
    assert request.request_id not in manager.req_to_blocks

    # A chunk that fits (4 new tokens -> 1 new block) succeeds and keeps the hits.
    new_blocks = manager.allocate_slots(request, 4, num_hit_tokens, hit_blocks)
    assert new_blocks is not None and len(new_blocks) == 1
    assert manager.get_block_ids(request.request_id) == [0, 1, new_blocks[0].block_id]
    manager.free(request)
    assert_all_blocks_free(manager)


def test_allocation_larger_than_the_pool_returns_none():
    manager = make_manager(num_blocks=2)
    request = make_request(list(range(9)))
    assert manager.allocate_slots(request, 9) is None
    assert_all_blocks_free(manager)


def test_stale_prefix_hits_are_rejected():
    manager = make_manager(num_blocks=2)
    owner = make_request(list(range(5)))
    prefill(manager, owner)
    manager.free(owner)
    request = make_request(list(range(5)))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 4
    thief = make_request(list(range(300, 308)))  # evicts both blocks, including the hit
    prefill(manager, thief)
    manager.free(thief)
    with pytest.raises(ValueError, match="call get_computed_blocks right before allocate_slots"):
        manager.allocate_slots(request, 1, num_hit_tokens, hit_blocks)
    with pytest.raises(ValueError, match="must equal"):
        manager.allocate_slots(request, 1, 8, hit_blocks)
    assert_all_blocks_free(manager)


# -- disaggregation: external computed tokens ---------------------------------------------------


def test_external_tokens_are_published_only_after_cache_blocks():
    manager = make_manager()
    prompt = list(range(14))
    local = make_request(prompt[:8] + [99])  # puts the first 2 blocks in the decode-side cache
    prefill(manager, local)
    manager.free(local)

    request = make_request(prompt)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 8
    num_external = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(
        request, 0, num_hit_tokens, hit_blocks, num_external_computed_tokens=num_external,
        delay_cache_blocks=True,
    )
    assert new_blocks is not None and len(new_blocks) == 2  # tokens 8..13
    assert len(manager.req_to_blocks[request.request_id]) == 4
    assert manager.pool.get_cached_block(request.block_hashes[2]) is None  # KV not landed yet
    _, hits_while_in_flight = manager.get_computed_blocks(make_request(prompt + [1, 2]))
    assert hits_while_in_flight == 8
    manager.check_invariants()

    request.num_computed_tokens = request.num_tokens  # remote KV landed
    manager.cache_blocks(request, request.num_computed_tokens)
    assert manager.pool.get_cached_block(request.block_hashes[2]) is new_blocks[0]
    assert len(request.block_hashes) == 3  # the partial block is not hashed

    request.append_output_token(500)
    assert manager.allocate_slots(request, 1) == []  # token 14 fits in the 4th block
    manager.free(request)
    assert_all_blocks_free(manager)


def test_freeing_before_remote_kv_lands_publishes_nothing():
    manager = make_manager()
    request = make_request(list(range(12)))
    blocks = manager.allocate_slots(
        request, 0, num_external_computed_tokens=12, delay_cache_blocks=True
    )
    assert blocks is not None and len(blocks) == 3
    manager.free(request)  # aborted: the peer died
    assert manager.pool.num_cached_blocks == 0
    assert_all_blocks_free(manager)


def test_cache_blocks_for_an_unknown_request_is_an_error():
    manager = make_manager()
    with pytest.raises(ValueError, match="allocate_slots first"):
        manager.cache_blocks(make_request([1, 2, 3, 4]), 4)
    assert_all_blocks_free(manager)


def test_slots_beyond_the_known_tokens_are_not_published():
    manager = make_manager()
    request = make_request(list(range(5)))
    new_blocks = manager.allocate_slots(request, 8)  # room for 3 tokens not sampled yet
    assert new_blocks is not None and len(new_blocks) == 2
    assert manager.num_cached_blocks[request.request_id] == 1
    assert new_blocks[1].block_hash is None and len(request.block_hashes) == 1
    manager.free(request)
    assert_all_blocks_free(manager)


# -- decode -------------------------------------------------------------------------------------


def test_decode_growth_crosses_block_boundaries():
    manager = make_manager()
    request = make_request([7, 8, 9])
    prefill(manager, request)
    assert len(manager.req_to_blocks[request.request_id]) == 1
    request.append_output_token(1000)

    for step in range(10):
        num_blocks_before = len(manager.req_to_blocks[request.request_id])
        new_blocks = manager.allocate_slots(request, 1)
        assert new_blocks is not None
        num_slots_needed = request.num_computed_tokens + 1
        expected_blocks = -(-num_slots_needed // BLOCK_SIZE)
        assert len(manager.req_to_blocks[request.request_id]) == expected_blocks
        assert len(new_blocks) == expected_blocks - num_blocks_before
        assert manager.num_cached_blocks[request.request_id] == num_slots_needed // BLOCK_SIZE
        request.num_computed_tokens += 1
        request.append_output_token(1001 + step)
        manager.check_invariants()

    # The published chain matches a fresh hash of the same tokens: a follower hits it.
    follower = make_request(request.all_token_ids[:12] + [5])
    _, num_hit_tokens = manager.get_computed_blocks(follower)
    assert num_hit_tokens == 12
    manager.free(request)
    assert_all_blocks_free(manager)


# -- lifecycle and checks -----------------------------------------------------------------------


def test_free_of_an_unknown_request_is_a_no_op():
    manager = make_manager()
    manager.free(make_request([1, 2, 3]))
    request = make_request([1, 2, 3])
    prefill(manager, request)
    manager.free(request)
    manager.free(request)  # second free of the same request: also a no-op
    assert manager.get_block_ids(request.request_id) == []
    assert_all_blocks_free(manager)


def test_invariants_catch_a_ref_count_that_does_not_match_holders():
    manager = make_manager()
    request = make_request(list(range(6)))
    prefill(manager, request)
    manager.req_to_blocks[request.request_id][0].ref_cnt += 1  # deliberate corruption
    with pytest.raises(KVCacheInvariantError, match="ref_cnt 2 but 1 holders"):
        manager.check_invariants()


def test_invariants_catch_a_request_holding_a_free_block():
    manager = make_manager()
    request = make_request(list(range(6)))
    prefill(manager, request)
    leaked = manager.req_to_blocks[request.request_id][1]
    manager.pool.free_blocks([leaked])  # freed behind the manager's back
    with pytest.raises(KVCacheInvariantError, match="ref_cnt 0"):
        manager.check_invariants()


def test_negative_counts_are_rejected():
    manager = make_manager()
    with pytest.raises(ValueError, match="num_new_tokens=-1 must be >= 0"):
        manager.allocate_slots(make_request([1, 2]), -1)
    assert_all_blocks_free(manager)
