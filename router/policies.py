"""Which engines serve a prompt: a decode engine, and a prefill engine unless the prompt is prefilled
on the decode engine itself (no prefill engines = colocated mode, or a short uncached prompt).

Prefill side:  round_robin | least_loaded (prompt tokens not yet prefilled) | prefix_aware (where the prompt's
               leading blocks were recently prefilled, among engines whose load is within
               PREFIX_BALANCE_TOKENS of the least loaded one).
Decode side:   round_robin | least_kv (fraction of the engine's KV that the requests open on it fill).

Load figures are the router's own ledger (EngineLink.open_tokens): the tokens of the requests it has open on each
engine, counted when it sends a prompt, grown by every token that comes back, and dropped when the request ends.
They are exact at the moment of each choice. The engines' heartbeats are not: an engine reports between steps,
its heartbeat repeats the last report during a step (seconds, for a long prompt on CPU), and a report says
nothing of the prompts sent or the requests ended since. Routing on reports put a burst of prompts on one
colocated engine mid-step and kept counting requests that had ended. Reports
still give each engine's KV capacity. Router replicas each balance the requests they route.
The prefix index mirrors each engine's cache with the engines' own block hashes
(engine.block_pool.compute_block_hashes), so router and engines agree on what a block is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockHash, compute_block_hashes
from pdserve.router.config import RouterConfig
from pdserve.router.errors import NoEngineAvailable
from pdserve.router.link import EngineLink

PREFIX_BALANCE_TOKENS = 4096  # prefix_aware prefers a cache hit unless its engine is this much busier
DEFAULT_INDEX_BLOCKS = 65536  # prefix index size of an engine that has not reported its cache size


class PrefixIndex:
    """The block hashes one engine computed recently, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def num_matched_blocks(self, hashes: Sequence[BlockHash]) -> int:
        count = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class PromptHashes:
    """A prompt's block hash chain, computed once per block size."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._by_block_size: dict[int, list[BlockHash]] = {}

    def for_block_size(self, block_size: int) -> list[BlockHash]:
        if block_size not in self._by_block_size:
            self._by_block_size[block_size] = compute_block_hashes(self.token_ids, block_size)
        return self._by_block_size[block_size]


@dataclass(frozen=True)
class Route:
    decode: EngineLink
    prefill: EngineLink | None  # None: the decode engine prefills the prompt itself
    num_uncached_tokens: int  # prompt tokens the decode engine's cache (as the router knows it) lacks
    prompt_hashes: PromptHashes  # the prompt's block hashes: a finished sequence's continue them (record_output)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_hashes.token_ids)


def engine_block_size(link: EngineLink) -> int:
    return link.info.block_size if link.info else 16


class RoutingPolicy:
    def __init__(self, config: RouterConfig) -> None:
        self.prefill_policy = config.prefill_policy
        self.decode_policy = config.decode_policy
        self.local_prefill_threshold = config.local_prefill_threshold
        self._next = {"prefill": 0, "decode": 0}
        self._indexes: dict[str, PrefixIndex] = {}  # control address -> index
        self.decisions = {"local": 0, "disaggregated": 0}  # routes by path (router.metrics reads them at scrape time)
        self.lean_changes = {"prefill": 0, "decode": 0, "none": 0}  # engines' lean changes by the lean taken (adaptive)

    def lean_of(self, address: str) -> int:
        """The engine's lean: 1 prefill, -1 decode, 0 none (only the adaptive policy's engines lean)."""
        return 0

    def route(self, token_ids: Sequence[int], prefills: list[EngineLink], decodes: list[EngineLink],
              force_local: bool = False, first_token_only: bool = False) -> Route:
        if not decodes:
            raise NoEngineAvailable("no decode engine is available: start one (`pdserve decode --router-address ...`) "
                                    "or wait until a registered engine answers its heartbeats")
        hashes = PromptHashes(token_ids)
        decode = self._pick_decode(decodes)
        decode_hashes = hashes.for_block_size(engine_block_size(decode))
        num_cached = self.index(decode).num_matched_blocks(decode_hashes) * engine_block_size(decode)
        num_uncached = len(token_ids) - num_cached
        prefill = None
        if prefills and not force_local and num_uncached > self.local_prefill_threshold:
            prefill = self._pick_prefill(prefills, hashes)
        if prefill is decode:  # a dual-role engine picked for both sides: it prefills its own request
            prefill = None
        if prefill is not None:
            self.index(prefill).add(hashes.for_block_size(engine_block_size(prefill)))
        if prefill is None or not first_token_only:  # else the decode engine never gets the prompt
            self.index(decode).add(decode_hashes)
        self.decisions["local" if prefill is None else "disaggregated"] += 1
        return Route(decode, prefill, num_uncached, hashes)

    def index(self, link: EngineLink) -> PrefixIndex:
        index = self._indexes.get(link.control_address)
        if index is None:
            capacity = link.stats.kv_blocks_total if link.stats else DEFAULT_INDEX_BLOCKS
            index = self._indexes[link.control_address] = PrefixIndex(max(capacity, 1))
        return index

    def record_output(self, link: EngineLink, token_ids: Sequence[int], prompt_hashes: PromptHashes | None = None
                      ) -> None:
        """A finished sequence (prompt + output) is cached on its decode engine: the next chat turn hits it.
        Nothing for an engine that left meanwhile (its index is forgotten). prompt_hashes: those of the prompt
        that token_ids start with (Route.prompt_hashes), so that only the output's blocks are hashed here."""
        if link.up:
            block_size = engine_block_size(link)
            known = prompt_hashes.for_block_size(block_size) if prompt_hashes is not None else ()
            self.index(link).add(compute_block_hashes(token_ids, block_size, known))

    def forget(self, link: EngineLink) -> None:
        """An engine left (or restarted): what it cached is gone."""
        self._indexes.pop(link.control_address, None)

    # ---- choices ----

    def _round_robin(self, side: str, links: list[EngineLink]) -> EngineLink:
        ordered = sorted(links, key=lambda link: link.control_address)
        link = ordered[self._next[side] % len(ordered)]
        self._next[side] += 1
        return link

    def _pick_decode(self, decodes: list[EngineLink]) -> EngineLink:
        if self.decode_policy == "round_robin" or len(decodes) == 1:
            return self._round_robin("decode", decodes)
        return min(decodes, key=lambda link: (kv_usage(link), link.num_inflight, link.control_address))

    def _pick_prefill(self, prefills: list[EngineLink], hashes: PromptHashes) -> EngineLink:
        if self.prefill_policy == "round_robin" or len(prefills) == 1:
            return self._round_robin("prefill", prefills)
        if self.prefill_policy == "least_loaded":
            return min(prefills, key=lambda link: (prefill_load(link), link.num_inflight, link.control_address))
        return self._prefix_aware(prefills, hashes)

    def _prefix_aware(self, prefills: list[EngineLink], hashes: PromptHashes) -> EngineLink:
        least_load = min(prefill_load(link) for link in prefills)
        candidates = [link for link in prefills if prefill_load(link) <= least_load + PREFIX_BALANCE_TOKENS]

        def preference(link: EngineLink) -> tuple:
            block_size = engine_block_size(link)
            num_matched = self.index(link).num_matched_blocks(hashes.for_block_size(block_size)) * block_size
            return -num_matched, prefill_load(link), link.num_inflight, link.control_address
        return min(candidates, key=preference)


def prefill_load(link: EngineLink) -> int:
    """Prompt tokens sent to a prefill engine and not yet prefilled: a prefill stream stays open until the
    prompt's first token (Submission.release_prefill)."""
    return link.open_tokens


def kv_usage(link: EngineLink) -> float:
    """Fraction of the engine's KV that the requests open on it fill: their prompts (prefilled or queued) and the
    tokens they have generated. Before its first report an engine counts as DEFAULT_INDEX_BLOCKS blocks."""
    blocks_total = link.stats.kv_blocks_total if link.stats and link.stats.kv_blocks_total else DEFAULT_INDEX_BLOCKS
    return link.open_tokens / (blocks_total * engine_block_size(link))
