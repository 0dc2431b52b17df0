"""KV block tables per layer group, on one shared BlockPool, for models whose layers do not all have one
sliding window (engine/kv_cache_groups.py): a sliding group frees a request's blocks as they leave its
window while a full-attention group keeps them. Same contract as KVCacheManager; block ids, prefix hits and
new blocks come as one entry per group.

Each group is a KVCacheManager on the shared pool whose prefix-cache keys carry the group's index, so a
hash names one block per group. A prefix hit of j blocks needs, in every group, each block that the first
token it leaves to compute still reads (all j for a full group, those in the window for a sliding one).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.block_pool import BlockPool, KVBlock, KVCacheInvariantError
from pdserve.engine.kv_cache_manager import KVCacheManager, PoolCounts, cdiv, holder_count_problems
from pdserve.engine.request import Request

GroupBlocks = tuple[list[KVBlock | None], ...]  # one list per group


class HybridKVCacheManager(PoolCounts):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windows: Sequence[int | None]) -> None:
        """windows: each group's sliding window (None: full attention), in group order."""
        if len(windows) < 2:
            raise ValueError(f"{len(windows)} layer group(s): a single group takes KVCacheManager")
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.groups = [
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, window, pool=self.pool,
                           hash_tag=index.to_bytes(2, "big"))
            for index, window in enumerate(windows)
        ]

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(group.get_block_ids(request_id) for group in self.groups)

    def max_blocks_held(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once when it computes at most
        max_chunk_tokens tokens a step: a sliding group holds its window and a chunk."""
        return self._blocks_held(num_tokens, lambda window: cdiv(window + max_chunk_tokens, self.block_size) + 1)

    def max_blocks_held_received(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once when its prompt KV arrives whole from a
        prefill engine and it then computes one token a step: a sliding group of window W keeps the blocks that
        the window of the token in hand reaches, at most ceil((W + B - 1) / B) (allocate_slots never allocates
        an external token's block before that window)."""
        return self._blocks_held(num_tokens, lambda window: cdiv(window + self.block_size - 1, self.block_size))

    def _blocks_held(self, num_tokens: int, window_blocks) -> int:
        """Every block of num_tokens tokens in a full group, at most window_blocks(window) in a sliding one."""
        whole = cdiv(num_tokens, self.block_size)
        return sum(whole if group.sliding_window is None else min(whole, window_blocks(group.sliding_window))
                   for group in self.groups)

    def largest_chunk_held(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The largest chunk, from 1 to max_chunk_tokens, with which a request of num_tokens tokens computed
        here holds at most the whole pool (max_blocks_held); 1 if none does (a chunk of one token holds what
        max_blocks_held_received counts)."""
        low, high = 1, max_chunk_tokens
        while low < high:
            middle = (low + high + 1) // 2
            if self.max_blocks_held(num_tokens, middle) <= self.pool.num_blocks:
                low = middle
            else:
                high = middle - 1
        return low

    # -- prefix lookup --------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest hit whose blocks every group still reads are cached, as (per-group blocks, tokens);
        capped before the last token, none for prompt logprobs (KVCacheManager.get_computed_blocks)."""
        empty = tuple([] for _ in self.groups)
        if not self.enable_caching:
            return empty, 0
        block_hashes = self.groups[0].update_block_hashes(request)
        if request.sampling_params.prompt_logprobs is not None:
            return empty, 0
        max_hit_blocks = max(request.num_tokens - 1, 0) // self.block_size
        lookups = [group.lookup_cached(block_hashes[:max_hit_blocks]) for group in self.groups]
        for num_blocks in range(max_hit_blocks, 0, -1):
            if all(group.hit_is_valid(last_missing, num_blocks)
                   for group, (_, last_missing) in zip(self.groups, lookups)):
                hits = tuple(group.hit_blocks(cached, num_blocks) for group, (cached, _) in zip(self.groups, lookups))
                return hits, num_blocks * self.block_size
        return empty, 0

    # -- allocation -----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | Sequence = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlocks | None:
        """KVCacheManager.allocate_slots for every group at once: all groups get their blocks, or none does
        (None; blocks that left a window are freed either way). new_computed_blocks: get_computed_blocks'
        per-group hits, or () for none. Returns each group's newly allocated blocks."""
        hits = new_computed_blocks or tuple(() for _ in self.groups)
        if len(hits) != len(self.groups):
            raise ValueError(f"allocate_slots: new_computed_blocks has {len(hits)} entries for {len(self.groups)} "
                             "layer groups; pass exactly what get_computed_blocks returned")
        plans = [group.plan_slots(request, num_new_tokens, num_new_computed_tokens, group_hits,
                                  num_external_computed_tokens)
                 for group, group_hits in zip(self.groups, hits)]
        if sum(plan.num_blocks_needed for plan in plans) > self.pool.num_free_blocks:
            return None
        for group, plan in zip(self.groups, plans):  # every group's free hits leave the free queue first
            group.take_hits(request, plan)
        return tuple(group.take_new_blocks(request, plan, delay_cache_blocks) for group, plan in zip(self.groups, plans))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for group in self.groups:
            group.cache_blocks(request, num_computed_tokens)

    def uncache_uncomputed(self, request: Request) -> None:
        for group in self.groups:
            group.uncache_uncomputed(request)

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    # -- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Pool invariants plus: each block's ref_cnt == number of (request, group) tables holding it, and no
        block in two groups' tables."""
        self.pool.check_invariants()
        num_holders = [0] * self.pool.num_blocks
        problems = [problem for group in self.groups for problem in group.count_holders(num_holders)]
        problems += holder_count_problems(self.pool, num_holders)
        owner: dict[int, int] = {}
        for index, group in enumerate(self.groups):
            for blocks in group.req_to_blocks.values():
                for block in filter(None, blocks):
                    if owner.setdefault(block.block_id, index) != index:
                        problems.append(f"block {block.block_id} is held by groups {owner[block.block_id]} and {index}")
        if problems:
            raise KVCacheInvariantError("hybrid KV cache manager is inconsistent:\n  " + "\n  ".join(problems))
