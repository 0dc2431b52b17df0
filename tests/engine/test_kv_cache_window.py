"""Sliding-window block freeing: a block leaves at the first step whose window no longer reaches it, prefix hits
stay exact, preempted requests recompute, and nothing leaks. Manager scenarios first, then whole engines
(colocated, where blocks are freed) against transformers' generate()."""

from __future__ import annotations

import pytest

from pdserve import LLM
from pdserve.engine.kv_cache_manager import SKIPPED_BLOCK_ID, KVCacheManager
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, assert_all_blocks_free, make_request, prefill
from tests.engine.test_llm_parity import (
    GREEDY_WITH_LOGPROBS, assert_matches_transformers, make_prompts, run_parity,
)

WINDOW = 6  # the token at position p sees positions p - 5 .. p


def make_manager(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BLOCK_SIZE, sliding_window=WINDOW)


def decode_one(manager: KVCacheManager, request, token_id: int = 7) -> None:
    """One decode step: room for the newest token, then it is computed and the next one sampled."""
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    request.append_output_token(token_id)


def held(manager: KVCacheManager, request) -> list[bool]:
    return [block is not None for block in manager.req_to_blocks[request.request_id]]


def test_a_block_is_freed_at_the_first_step_that_no_longer_sees_it():
    manager = make_manager()
    request = make_request(list(range(100, 120)))  # 20 tokens: blocks 0-4
    prefill(manager, request)
    request.append_output_token(7)  # the first sampled token, at position 20
    assert held(manager, request) == [True] * 5 and manager.num_used_blocks == 5
    # Position 20 sees 15..20: blocks 0-2 (positions 0-11) leave, block 3 (12-15) stays.
    decode_one(manager, request)
    assert held(manager, request) == [False, False, False, True, True, True]
    assert manager.get_block_ids(request.request_id)[:3] == [SKIPPED_BLOCK_ID] * 3
    assert manager.num_used_blocks == 3
    # Position 21 sees 16..21: block 3 leaves now, not before.
    decode_one(manager, request)
    assert held(manager, request) == [False, False, False, False, True, True]
    assert manager.num_used_blocks == 2
    manager.check_invariants()
    manager.free(request)
    assert_all_blocks_free(manager)


def test_chunked_prefill_frees_what_the_next_chunk_cannot_see():
    manager = make_manager()
    request = make_request(list(range(200, 230)))  # 30 tokens in chunks of 12
    for chunk in (12, 12, 6):
        assert manager.allocate_slots(request, chunk) is not None
        request.num_computed_tokens += chunk
    # The last chunk started at position 24, which sees 19..24: blocks 0-3 (0-15) had left.
    assert held(manager, request) == [False] * 4 + [True] * 4
    manager.check_invariants()
    manager.free(request)
    assert_all_blocks_free(manager)


def test_freed_blocks_stay_cached_and_a_prefix_hit_is_exact():
    manager = make_manager()
    first = make_request(list(range(300, 320)))
    prefill(manager, first)
    first.append_output_token(7)
    original = list(manager.req_to_blocks[first.request_id][:5])
    for _ in range(3):  # positions 20-22; position 22 sees 17..22
        decode_one(manager, first)
    assert held(manager, first)[:5] == [False] * 4 + [True]
    assert all(block.ref_cnt == 0 and block.block_hash is not None for block in original[:4])  # freed, cached

    second = make_request(list(range(300, 320)) + [1, 2, 3])  # 23 tokens: hits may cover 5 blocks
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    # Position 20 sees 15..20: only blocks 3 (12-15) and 4 are needed, and they are the first request's.
    assert hits == [None] * 3 + original[3:] and num_hit_tokens == 20
    assert [block.block_hash for block in hits[3:]] == second.block_hashes[3:5]
    assert manager.allocate_slots(second, second.num_tokens - num_hit_tokens, num_hit_tokens, hits) is not None
    # Hits 0-2 were never taken, hit 3 is held again, hit 4 is shared.
    assert held(manager, second) == [False, False, False, True, True, True]
    assert [block.ref_cnt for block in original] == [0, 0, 0, 1, 2]
    manager.check_invariants()
    manager.free(first)
    manager.free(second)
    assert_all_blocks_free(manager)


def test_a_hit_needs_only_the_blocks_inside_the_window():
    """An evicted early block ends a plain prefix hit, but not one whose first new token cannot see it."""
    manager = make_manager()
    first = make_request(list(range(600, 620)))
    prefill(manager, first)
    manager.free(first)
    blocks = [manager.pool.get_cached_block(h) for h in first.block_hashes]
    manager.pool.uncache([blocks[0]])  # evicted
    second = make_request(list(range(600, 620)) + [5])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 20 and hits == [None] * 3 + blocks[3:5]
    manager.pool.uncache([blocks[3]])  # now the window of position 20 misses a block: the hit shrinks
    hits, num_hit_tokens = manager.get_computed_blocks(make_request(list(range(600, 620)) + [5]))
    assert num_hit_tokens == 12 and hits == [None] + blocks[1:3]  # position 12 sees 7..12 (blocks 1-2)
    plain = KVCacheManager(16, block_size=BLOCK_SIZE)
    plain.pool = manager.pool
    assert plain.get_computed_blocks(make_request(list(range(600, 620)) + [5])) == ([], 0)
    assert_all_blocks_free(manager)


def test_a_preempted_request_frees_everything_and_recomputes_from_its_cached_prefix():
    manager = make_manager()
    request = make_request(list(range(400, 420)))
    prefill(manager, request)
    request.append_output_token(7)
    for _ in range(4):
        decode_one(manager, request)
    manager.free(request)  # preemption: every block it still holds goes back
    assert_all_blocks_free(manager)
    request.num_computed_tokens = 0
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == (request.num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but the last
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits) is not None
    assert held(manager, request) == [False] * 4 + [True] * 3  # position 24 sees 19..24
    manager.check_invariants()
    manager.free(request)
    assert_all_blocks_free(manager)


def test_without_a_window_every_block_is_kept():
    manager = KVCacheManager(16, block_size=BLOCK_SIZE)
    request = make_request(list(range(500, 520)))
    prefill(manager, request)
    request.append_output_token(7)
    decode_one(manager, request)
    assert all(held(manager, request))
    manager.free(request)
    assert_all_blocks_free(manager)


# ---------------------------------------------------------------------------------------------
# Whole engines: Mistral (every layer slides) frees blocks; transformers' tokens all the same
# ---------------------------------------------------------------------------------------------


def _record_peak_use(llm: LLM, monkeypatch) -> list[int]:
    manager, seen = llm.kv_cache_manager, []
    allocate = manager.allocate_slots

    def recording(*args, **kwargs):
        blocks = allocate(*args, **kwargs)
        seen.append(manager.num_used_blocks)
        return blocks

    monkeypatch.setattr(manager, "allocate_slots", recording)
    return seen


def test_colocated_engine_frees_blocks_that_left_the_window(model_factory, monkeypatch):
    """One 70-token prompt, 12 new tokens, chunks of 16: at most the window and a chunk are held at once."""
    model_dir = model_factory("mistral", sliding_window=7)
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    assert llm.kv_cache_manager.sliding_window == 7
    used = _record_peak_use(llm, monkeypatch)
    prompt = make_prompts(1024, seed=6)[7]
    assert len(prompt) == 70
    outputs = llm.generate([{"prompt_token_ids": prompt}], GREEDY_WITH_LOGPROBS)
    assert_matches_transformers(model_dir, [prompt], outputs)
    assert max(used) <= (7 + 16) // 4 + 2 < (70 + 12) // 4  # without freeing: 21 blocks
    assert llm.kv_cache_manager.num_used_blocks == 0
    llm.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("num_kv_blocks", [256, 21])  # 21 blocks of 4: requests are preempted and recomputed
def test_colocated_window_freeing_keeps_parity(model_factory, num_kv_blocks):
    """Many prompts past the window, repeats that hit the prefix cache, chunked prefills; then the same
    prompts again, served from cached blocks that had left the window."""
    model_dir = model_factory("mistral", sliding_window=7)
    prompts = make_prompts(1024, seed=7)
    llm = run_parity(model_dir, prompts, max_num_batched_tokens=16, num_kv_blocks=num_kv_blocks)
    assert llm.kv_cache_manager.sliding_window == 7
    if num_kv_blocks == 21:
        assert llm.engine.scheduler.num_preemptions > 0
    before = llm.engine.stats().prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    assert llm.engine.stats().prefix_cache_hits > before
    assert_matches_transformers(model_dir, prompts, again, label="cached run, ")
    assert llm.kv_cache_manager.num_used_blocks == 0
    llm.kv_cache_manager.check_invariants()


def test_mixed_layers_keep_every_block(model_factory):
    """A model whose layers do not all slide (here: none does) keeps every block."""
    llm = LLM(model_factory("llama"), dtype="float32", block_size=4, num_kv_blocks=16)
    assert llm.kv_cache_manager.sliding_window is None
