"""KV cache blocks: reference counts, the hash -> block map of cached blocks, and the LRU free queue.

Torch-free bookkeeping. A block is *free* when no request holds it (ref_cnt == 0); a free block may
still be *cached* (it has a block_hash and sits in the hash map) until it is evicted, i.e. handed
out again by get_new_blocks(). Free blocks wait in one queue: eviction pops from the head.

Queue order: a freed block that is cached goes to the tail (so the least recently freed cached
block is evicted first); a freed block with no hash goes to the head, since reusing it loses no
cached content. Callers free a request's blocks tail first, so its tail blocks are evicted first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack

BlockHash = bytes


class KVCacheInvariantError(AssertionError):
    """The block bookkeeping is inconsistent: a bug in the caller or in the pool, never user input."""


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """One KV cache block; eq=False so blocks compare and hash by identity."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


# ---------------------------------------------------------------------------------------------
# Block hashes: stable across processes (prefill, decode and router must agree), so hashlib over a
# msgpack encoding, never Python's hash().


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """sha256 of (parent hash, the block's token ids, extra keys); None parent = first block."""
    try:
        payload = msgpack.packb((parent_hash, list(token_ids), tuple(extra_keys)))
    except TypeError as exc:
        raise TypeError(
            f"cannot hash block: token ids must be Python ints and extra keys ints/str/bytes/"
            f"tuples ({exc}); convert tensors or numpy values with .tolist() first"
        ) from exc
    return hashlib.sha256(payload).digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    start_hashes: Sequence[BlockHash] = (),
    extra_keys: tuple = (),
) -> list[BlockHash]:
    """The hash chain over the full blocks of token_ids, continuing start_hashes.

    start_hashes are the already known hashes of the first blocks; the result is the whole chain
    (start_hashes included). A trailing partial block is not hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be a positive number of tokens")
    hashes = list(start_hashes)
    num_full_blocks = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for block_idx in range(len(hashes), num_full_blocks):
        start = block_idx * block_size
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


# ---------------------------------------------------------------------------------------------


class BlockPool:
    """Owns num_blocks KVBlocks (ids 0..num_blocks-1, all ordinary), their free queue and hash map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(
                f"num_blocks={num_blocks}: the KV cache needs at least one block; "
                "give it more memory or a smaller block size"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # block_id -> block, head first; holds exactly the blocks with ref_cnt == 0.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    # -- counts ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first); for tests and debugging."""
        return list(self._free_queue)

    # -- allocation ---------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop num_blocks from the head of the free queue, evicting their cached hashes; ref_cnt = 1."""
        if num_blocks > len(self._free_queue):
            raise NoFreeBlocksError(
                f"asked for {num_blocks} KV blocks but only {len(self._free_queue)} are free: "
                "check num_free_blocks first (allocate_slots does), or give the KV cache more blocks"
            )
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Take blocks out of the prefix cache (their content is not what their hash says)."""
        for block in blocks:
            self._evict(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if self._free_queue.pop(block.block_id, None) is None:
                    raise KVCacheInvariantError(f"block {block.block_id} has ref 0 but is not in the free queue")
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block; pass a request's blocks tail first (reverse order)."""
        uncached = []
        for block in blocks:
            if block.ref_cnt <= 0:
                raise KVCacheInvariantError(
                    f"block {block.block_id} freed with ref_cnt={block.ref_cnt}: freed twice or never held"
                )
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                uncached.append(block)
            else:
                self._free_queue[block.block_id] = block  # tail: evicted last
        # Blocks without content go to the head, keeping the caller's order among them.
        for block in reversed(uncached):
            self._free_queue[block.block_id] = block
            self._free_queue.move_to_end(block.block_id, last=False)

    # -- prefix cache ---------------------------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock | None],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Publish blocks[num_cached_blocks:num_full_blocks] under block_hashes[i].

        A hash already mapped to another block keeps that mapping and this block stays unpublished
        (same content twice is harmless); a block already published under the same hash is skipped, and
        so is a None entry (a block the request freed when it left the sliding window).
        """
        if not self.enable_caching:
            return
        if not 0 <= num_cached_blocks <= num_full_blocks <= min(len(blocks), len(block_hashes)):
            raise ValueError(
                f"cache_full_blocks range [{num_cached_blocks}, {num_full_blocks}) does not fit "
                f"{len(blocks)} blocks and {len(block_hashes)} hashes: hash the tokens before publishing"
            )
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks], block_hashes[num_cached_blocks:num_full_blocks]
        ):
            if block is not None:
                self._publish(block, block_hash)

    def _publish(self, block: KVBlock, block_hash: BlockHash) -> None:
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise KVCacheInvariantError(
                    f"block {block.block_id} is already cached under another hash; "
                    "a block's content cannot change while it is cached"
                )
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            block.block_hash = block_hash

    # -- checks ---------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise KVCacheInvariantError listing every inconsistency found."""
        problems = self._block_problems() + self._free_queue_problems() + self._hash_map_problems()
        if problems:
            raise KVCacheInvariantError("KV block pool is inconsistent:\n  " + "\n  ".join(problems))

    def _block_problems(self) -> list[str]:
        problems = []
        for index, block in enumerate(self.blocks):
            if block.block_id != index:
                problems.append(f"blocks[{index}] has block_id {block.block_id}")
            if block.ref_cnt < 0:
                problems.append(f"block {block.block_id} has negative ref_cnt {block.ref_cnt}")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                problems.append(f"block {block.block_id} has a hash but the hash map does not point to it")
        return problems

    def _free_queue_problems(self) -> list[str]:
        problems = []
        for block_id, block in self._free_queue.items():
            if not 0 <= block_id < self.num_blocks or self.blocks[block_id] is not block:
                problems.append(f"free queue entry {block_id} is not the pool's block {block_id}")
        free_ids = set(self._free_queue)
        zero_ref_ids = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        if free_ids != zero_ref_ids:
            problems.append(
                f"free queue != blocks with ref 0: only queued {sorted(free_ids - zero_ref_ids)}, "
                f"only ref 0 {sorted(zero_ref_ids - free_ids)}"
            )
        return problems

    def _hash_map_problems(self) -> list[str]:
        problems = []
        if not self.enable_caching and self._cached:
            problems.append(f"caching is off but {len(self._cached)} blocks are cached")
        seen_ids: set[int] = set()
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                problems.append(f"hash map entry points to block {block.block_id} whose hash differs")
            if block.block_id in seen_ids:
                problems.append(f"block {block.block_id} appears under several hashes")
            seen_ids.add(block.block_id)
            if not 0 <= block.block_id < self.num_blocks or self.blocks[block.block_id] is not block:
                problems.append(f"hash map points to a block {block.block_id} the pool does not own")
        return problems
