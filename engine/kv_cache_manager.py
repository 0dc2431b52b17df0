"""Per-request KV block tables on top of the BlockPool: prefix lookup, allocate_slots, free.

Torch-free and counted in tokens. A request's blocks cover its tokens in this layout:

    | computed | new computed (prefix hits) | external computed (remote prefill) | new (this step) |
      request.num_computed_tokens

A full block is published to the prefix cache (hash -> block) once its KV is (or will be, within
the step in flight) valid; blocks waiting for remote KV are published later by cache_blocks().

With a sliding window shared by every layer, a block whose tokens all left the window of the request's
next token is freed at the next allocate_slots (external tokens' blocks before the window of the first
token computed after them are never allocated) and its entry becomes None (get_block_ids shows
SKIPPED_BLOCK_ID there, a position attention never reads). A freed block stays in the prefix cache until
evicted; a prefix hit needs only the cached blocks its first new token can see.

KV from a prefill engine holds, for sliding-window layers, only the blocks the window of the first decoded
token reaches (docs/design/kv-link.md): the blocks before hold no valid KV of those layers, so they are
never published to the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool, KVBlock, KVCacheInvariantError, compute_block_hashes
from pdserve.engine.request import Request


# The block id a freed, out-of-window position shows in a block table: any valid id does, since
# attention reads no position outside a query's window.
SKIPPED_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class SlotPlan:
    """What allocate_slots will do for one request, counted before any block is taken."""

    hits: list[KVBlock | None]  # the prefix hits to append (None: before the window, never taken)
    num_unneeded: int  # positions after the hits that lie before the window: None entries, no block
    num_new_blocks: int  # blocks to take from the pool
    num_free_hits: int  # hits that sit in the free queue: touching them takes them from the supply
    num_total_tokens: int

    @property
    def num_blocks_needed(self) -> int:
        return self.num_new_blocks + self.num_free_hits


class PoolCounts:
    """The block counts of a manager's `pool` (KVCacheManager's, and the hybrid manager's shared one)."""

    pool: BlockPool

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks


class KVCacheManager(PoolCounts):
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, external_kv_window: int | None = None,
                 pool: BlockPool | None = None, hash_tag: bytes = b"") -> None:
        """sliding_window: the window of every layer, whose blocks are freed as they leave it; None keeps
        every block of a request until it is freed. external_kv_window: the smallest sliding window of any
        layer, on an engine that takes prompt KV from a prefill engine (None: no layer slides).
        pool and hash_tag: a block pool shared with other layer groups' tables, and the suffix of this
        group's prefix-cache keys (engine/hybrid_kv_cache_manager.py); by default its own pool, no suffix."""
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be a positive number of tokens per block")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be a positive number of tokens, or None")
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.external_kv_window = external_kv_window
        self.pool = pool if pool is not None else BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.hash_tag = hash_tag
        # None: a block freed after it left the window
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        # request_id -> how many of its leading blocks are published in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    def get_block_ids(self, request_id: str) -> list[int]:
        blocks = self.req_to_blocks.get(request_id, ())
        return [SKIPPED_BLOCK_ID if block is None else block.block_id for block in blocks]

    # -- prefix lookup --------------------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> list[bytes]:
        """Extend request.block_hashes over its new full blocks (only those) and return it."""
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            chain = compute_block_hashes(request.all_token_ids, self.block_size, hashes)
            hashes.extend(chain[len(hashes):])
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock | None], int]:
        """Longest cached prefix of the request as (blocks, num_tokens); takes no references.

        Hits stop before the last token (capped at num_tokens - 1, whole blocks) so that at least
        one token is computed and yields logits. A request that asks for prompt logprobs gets no hit (as
        vLLM): they come from the logits of every prompt position. With a sliding window, only the blocks
        the first computed token can see must be cached: the ones before it are None.
        """
        if not self.enable_caching:
            return [], 0
        block_hashes = self.update_block_hashes(request)
        if request.sampling_params.prompt_logprobs is not None:  # every prompt position must be computed
            return [], 0
        max_hit_blocks = max(request.num_tokens - 1, 0) // self.block_size
        if self.sliding_window is not None:
            return self._window_hit(block_hashes[:max_hit_blocks])
        hit_blocks = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash + self.hash_tag)
            if block is None:
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        return hit_blocks, num_hit_tokens

    def _window_hit(self, block_hashes: list[bytes]) -> tuple[list[KVBlock | None], int]:
        """The longest hit of j blocks whose blocks from the window of position j x B on are all cached (a
        block's hash covers its whole prefix, so the blocks before need not be)."""
        cached, last_missing = self.lookup_cached(block_hashes)
        for num_blocks in range(len(cached), 0, -1):
            if self.hit_is_valid(last_missing, num_blocks):
                return self.hit_blocks(cached, num_blocks), num_blocks * self.block_size
        return [], 0

    def lookup_cached(self, block_hashes: list[bytes]) -> tuple[list[KVBlock | None], list[int]]:
        """This group's cached block of each hash (None: not cached), and for each index i the last index
        <= i that is not cached (-1: none)."""
        cached = [self.pool.get_cached_block(block_hash + self.hash_tag) for block_hash in block_hashes]
        last_missing, missing = [], -1
        for index, block in enumerate(cached):
            missing = index if block is None else missing
            last_missing.append(missing)
        return cached, last_missing

    def first_needed_block(self, num_blocks: int) -> int:
        """The first block a request whose first num_blocks blocks are computed still reads: the window of
        position num_blocks x B reaches back to it (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_blocks * self.block_size - self.sliding_window + 1) // self.block_size

    def hit_is_valid(self, last_missing: list[int], num_blocks: int) -> bool:
        """Whether a hit of num_blocks blocks has every block it still reads cached (lookup_cached's list)."""
        return last_missing[num_blocks - 1] < self.first_needed_block(num_blocks)

    def hit_blocks(self, cached: list[KVBlock | None], num_blocks: int) -> list[KVBlock | None]:
        first = self.first_needed_block(num_blocks)
        return [None] * first + cached[first:num_blocks]

    # -- allocation -----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVBlock] | None:
        """Give the request blocks for every token up to the end of `new`; None (and no change, but for
        blocks that left the sliding window, freed either way) if the pool cannot. Returns only the newly
        allocated blocks (not new_computed_blocks)."""
        plan = self.plan_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                               num_external_computed_tokens)
        if plan.num_blocks_needed > self.pool.num_free_blocks:
            return None
        self.take_hits(request, plan)
        return self.take_new_blocks(request, plan, delay_cache_blocks)

    def plan_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                   new_computed_blocks: Sequence[KVBlock | None] = (),
                   num_external_computed_tokens: int = 0) -> SlotPlan:
        """Check allocate_slots' arguments, free the blocks that left the window, and count what the rest
        needs from the pool; take_hits and take_new_blocks do it."""
        hits = list(new_computed_blocks)
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        self._check_allocate_args(
            request, req_blocks, num_new_tokens, num_new_computed_tokens, hits, num_external_computed_tokens,
        )
        num_total_tokens = (request.num_computed_tokens + num_new_computed_tokens
                            + num_external_computed_tokens + num_new_tokens)
        num_unneeded = self._free_outside_window(req_blocks, request.num_computed_tokens + num_new_computed_tokens
                                                 + num_external_computed_tokens, hits)
        num_new_blocks = max(
            0, cdiv(num_total_tokens, self.block_size) - len(req_blocks) - len(hits) - num_unneeded
        )
        # Touching a free cached hit takes it out of the free queue, so it counts against the supply.
        num_free_hits = sum(1 for block in hits if block is not None and block.ref_cnt == 0)
        return SlotPlan(hits, num_unneeded, num_new_blocks, num_free_hits, num_total_tokens)

    def take_hits(self, request: Request, plan: SlotPlan) -> None:
        """The plan's prefix hits join the request's blocks; a free one leaves the free queue, so no
        get_new_blocks (of this table or another on the same pool) can hand it out after this."""
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self._append_computed_blocks(request.request_id, req_blocks, plan.hits)

    def take_new_blocks(self, request: Request, plan: SlotPlan, delay_cache_blocks: bool = False) -> list[KVBlock]:
        """The rest of the plan, after take_hits: the skipped positions, then the new blocks."""
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        req_blocks.extend([None] * plan.num_unneeded)
        new_blocks = self.pool.get_new_blocks(plan.num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(plan.num_total_tokens, request.num_tokens))
        return new_blocks

    def _free_outside_window(self, req_blocks: list[KVBlock | None], first_new_position: int,
                             hits: list[KVBlock]) -> int:
        """Free the held blocks (and drop the prefix hits) whose tokens all lie before the window of the
        token at first_new_position, the first this request computes from now on. Returns how many blocks
        after those and the hits lie before it too: external tokens' blocks that nothing will read (a KV
        link sends a sliding layer only its window), which need no allocation."""
        if self.sliding_window is None:
            return 0
        num_skipped = max(0, first_new_position - self.sliding_window + 1) // self.block_size
        leaving = [i for i in range(min(num_skipped, len(req_blocks))) if req_blocks[i] is not None]
        self.pool.free_blocks(req_blocks[i] for i in reversed(leaving))
        for i in leaving:
            req_blocks[i] = None
        num_hits_skipped = min(max(0, num_skipped - len(req_blocks)), len(hits))
        hits[:num_hits_skipped] = [None] * num_hits_skipped  # never touched: they stay as they are
        return max(0, num_skipped - len(req_blocks) - len(hits))

    def _check_allocate_args(
        self,
        request: Request,
        req_blocks: list[KVBlock],
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: list[KVBlock],
        num_external_computed_tokens: int,
    ) -> None:
        counts = {"num_new_tokens": num_new_tokens, "num_new_computed_tokens": num_new_computed_tokens,
                  "num_external_computed_tokens": num_external_computed_tokens}
        for name, value in counts.items():
            if value < 0:
                raise ValueError(f"allocate_slots: {name}={value} must be >= 0")
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"allocate_slots: num_new_computed_tokens={num_new_computed_tokens} must equal "
                f"{len(new_computed_blocks)} new_computed_blocks x block_size {self.block_size}; "
                "pass exactly what get_computed_blocks returned"
            )
        if new_computed_blocks:
            self._check_hits_fit(request, req_blocks, new_computed_blocks)

    def _check_hits_fit(self, request: Request, req_blocks: list[KVBlock], hits: list[KVBlock]) -> None:
        first = len(req_blocks)
        if request.num_computed_tokens != first * self.block_size:
            raise ValueError(
                f"allocate_slots: request {request.request_id} has {request.num_computed_tokens} computed "
                f"tokens in {first} blocks; prefix hits must start right after whole computed blocks"
            )
        block_hashes = self.update_block_hashes(request) if self.enable_caching else []
        for offset, block in enumerate(hits):
            index = first + offset
            if block is None and self.sliding_window is not None:  # before the window: not needed
                continue
            if block is None or index >= len(block_hashes) or block.block_hash != block_hashes[index] + self.hash_tag:
                block_name = "None" if block is None else f"block {block.block_id}"
                raise ValueError(
                    f"allocate_slots: new_computed_blocks[{offset}] ({block_name}) does not hold "
                    f"request {request.request_id}'s cached block {index}: it was evicted or belongs to "
                    "another prefix; call get_computed_blocks right before allocate_slots"
                )

    def _append_computed_blocks(self, request_id: str, req_blocks: list[KVBlock | None],
                                hits: list[KVBlock | None]) -> None:
        if not hits:
            return
        self.pool.touch(block for block in hits if block is not None)
        num_cached = self.num_cached_blocks.get(request_id, 0)
        if num_cached == len(req_blocks):
            # Hits are already published: the cached prefix grows by them.
            self.num_cached_blocks[request_id] = num_cached + len(hits)
        req_blocks.extend(hits)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks covering its first num_computed_tokens tokens."""
        if not self.enable_caching:
            return
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None:
            raise ValueError(
                f"cache_blocks: request {request.request_id} holds no blocks; call allocate_slots first"
            )
        num_tokens = min(num_computed_tokens, request.num_tokens)
        if num_tokens > len(req_blocks) * self.block_size:
            raise ValueError(
                f"cache_blocks: {num_tokens} tokens do not fit request {request.request_id}'s "
                f"{len(req_blocks)} blocks of {self.block_size}"
            )
        num_full_blocks = num_tokens // self.block_size
        num_cached = max(self.num_cached_blocks.get(request.request_id, 0), self._first_whole_block(request))
        if num_full_blocks <= num_cached:
            return
        block_hashes = self.update_block_hashes(request)
        if self.hash_tag:
            block_hashes = [block_hash + self.hash_tag for block_hash in block_hashes[:num_full_blocks]]
        self.pool.cache_full_blocks(req_blocks, block_hashes, num_cached, num_full_blocks)
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def _first_whole_block(self, request: Request) -> int:
        """The first block that holds every layer's KV: the window of the first decoded token's start for a
        request whose prompt KV came from a prefill engine on a model with sliding layers, else 0."""
        window = self.external_kv_window
        if window is None or request.num_external_computed_tokens == 0:
            return 0
        return max(0, request.num_prompt_tokens - window + 1) // self.block_size

    def uncache_uncomputed(self, request: Request) -> None:
        """Unpublish the request's blocks past its computed tokens: allocate_slots published them for
        a step that failed, so their KV may be half-written."""
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed_blocks = request.num_computed_tokens // self.block_size
        self.pool.uncache(block for block in req_blocks[num_computed_blocks:] if block is not None)
        if self.num_cached_blocks.get(request.request_id, 0) > num_computed_blocks:
            self.num_cached_blocks[request.request_id] = num_computed_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its tail is evicted first; unknown: no-op."""
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if req_blocks:
            self.pool.free_blocks(block for block in reversed(req_blocks) if block is not None)

    # -- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Pool invariants plus: each block's ref_cnt == number of requests holding it."""
        self.pool.check_invariants()
        num_holders = [0] * self.pool.num_blocks
        problems = self.count_holders(num_holders)
        problems += holder_count_problems(self.pool, num_holders)
        if problems:
            raise KVCacheInvariantError("KV cache manager is inconsistent:\n  " + "\n  ".join(problems))

    def count_holders(self, num_holders: list[int]) -> list[str]:
        """Add one to num_holders[block id] per request holding the block; the problems found on the way."""
        problems = []
        for request_id, all_blocks in self.req_to_blocks.items():
            req_blocks = [block for block in all_blocks if block is not None]  # None: left the window, freed
            if len({block.block_id for block in req_blocks}) != len(req_blocks):
                problems.append(f"request {request_id} holds a block twice")
            if self.num_cached_blocks.get(request_id, 0) > len(all_blocks):
                problems.append(f"request {request_id} has more cached blocks than blocks")
            for block in req_blocks:
                if not 0 <= block.block_id < self.num_blocks or self.pool.blocks[block.block_id] is not block:
                    problems.append(f"request {request_id} holds a block {block.block_id} not from the pool")
                    continue
                if block.ref_cnt < 1:
                    problems.append(f"request {request_id} holds block {block.block_id} with ref_cnt 0")
                num_holders[block.block_id] += 1
        return problems


def holder_count_problems(pool: BlockPool, num_holders: list[int]) -> list[str]:
    return [
        f"block {block.block_id} has ref_cnt {block.ref_cnt} but {num_holders[block.block_id]} holders"
        for block in pool.blocks if block.ref_cnt != num_holders[block.block_id]
    ]
