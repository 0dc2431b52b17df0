"""Routing policies on engines described by the router's ledger of them (no sockets needed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.control.messages import EngineStats, Register
from pdserve.engine.block_pool import compute_block_hashes
from pdserve.router.config import RouterConfig
from pdserve.router.errors import NoEngineAvailable
from pdserve.router.policies import PREFIX_BALANCE_TOKENS, PrefixIndex, RoutingPolicy

BLOCK = 4


@dataclass
class Link:
    """The parts of router.link.EngineLink that policies read."""

    control_address: str
    role: str = "decode"
    open_tokens: int = 0  # the router's ledger: tokens of the requests open on the engine
    kv_blocks_used: int = 0  # what the engine last reported (policies must not route by it)
    queued_prefill_tokens: int = 0
    num_inflight: int = 0
    up: bool = True
    info: Register = field(init=False)

    def __post_init__(self) -> None:
        self.info = Register(engine_id=self.control_address, role=self.role, control_address=self.control_address,
                             kv_address="tcp://127.0.0.1:9" if self.role == "prefill" else None,
                             block_size=BLOCK, max_model_len=512, vocab_size=1024)

    kv_blocks_total: int = field(init=False, default=100)

    @property
    def stats(self) -> EngineStats:  # the latest report: the fields above
        return EngineStats(engine_id=self.control_address, role=self.role, num_waiting=0, num_running=0,
                           kv_blocks_used=self.kv_blocks_used, kv_blocks_total=self.kv_blocks_total,
                           queued_prefill_tokens=self.queued_prefill_tokens)


def policy(**overrides) -> RoutingPolicy:
    return RoutingPolicy(RouterConfig(model="m", served_model_name="m", **overrides))


def test_no_decode_engine_is_503():
    with pytest.raises(NoEngineAvailable):
        policy().route([1, 2, 3], [Link("p", "prefill")], [])


def test_round_robin_alternates_on_both_sides():
    rr = policy(prefill_policy="round_robin", decode_policy="round_robin")
    prefills, decodes = [Link("p1", "prefill"), Link("p0", "prefill")], [Link("d0"), Link("d1")]
    routes = [rr.route([i, i + 1, i + 2, i + 3, i + 4], prefills, decodes) for i in range(4)]
    assert [r.prefill.control_address for r in routes] == ["p0", "p1", "p0", "p1"]
    assert [r.decode.control_address for r in routes] == ["d0", "d1", "d0", "d1"]


def test_least_kv_routes_by_the_ledger_not_by_reports():
    """Reports lag: one taken before a prompt came, repeated while the engine computes it, says the engine is idle;
    one taken before requests ended still counts them. The ledger is the load now."""
    least = policy(decode_policy="least_kv")
    computing = Link("computing", open_tokens=45 * BLOCK, kv_blocks_used=0)
    drained = Link("drained", open_tokens=10 * BLOCK, kv_blocks_used=80, queued_prefill_tokens=300)
    assert least.route(list(range(8)), [], [computing, drained]).decode is drained
    drained.open_tokens = 46 * BLOCK
    assert least.route(list(range(8)), [], [computing, drained]).decode is computing


def test_least_kv_compares_fractions_of_each_engines_capacity():
    least = policy(decode_policy="least_kv")
    small, large = Link("small", open_tokens=30 * BLOCK), Link("large", open_tokens=40 * BLOCK)
    large.kv_blocks_total = 200
    assert least.route(list(range(8)), [], [small, large]).decode is large, "20% of 200 blocks < 30% of 100"


def test_no_prefill_engine_or_short_uncached_prompt_prefills_on_decode():
    colocated = policy().route(list(range(20)), [], [Link("d")])
    assert colocated.prefill is None and colocated.num_uncached_tokens == 20
    conditional = policy(local_prefill_threshold=8)
    prefills, decodes = [Link("p", "prefill")], [Link("d")]
    assert conditional.route(list(range(5)), prefills, decodes).prefill is None, "5 tokens <= 8: local"
    assert conditional.route(list(range(100, 140)), prefills, decodes).prefill is not None, "40 tokens: remote"
    # the decode engine now holds those 40 tokens: a follow-up sharing them has 6 uncached tokens
    follow_up = conditional.route(list(range(100, 140)) + [7] * 6, prefills, decodes)
    assert follow_up.num_uncached_tokens == 6 and follow_up.prefill is None
    assert conditional.route(list(range(100, 140)) + [7] * 6, prefills, decodes, force_local=True).prefill is None


def test_a_prompt_whose_first_token_is_its_answer_is_not_learnt_on_the_decode_engine():
    """max_tokens=1 through a prefill engine: the decode engine never gets the prompt, so the same prompt next
    time is still uncached there (and prefilled remotely again, not locally on a cache it does not have)."""
    conditional = policy(local_prefill_threshold=8)
    prefills, decodes = [Link("p", "prefill")], [Link("d")]
    prompt = list(range(100, 140))
    assert conditional.route(prompt, prefills, decodes, first_token_only=True).prefill is not None
    again = conditional.route(prompt, prefills, decodes)
    assert again.num_uncached_tokens == 40 and again.prefill is not None
    colocated = conditional.route(list(range(200, 240)), [], decodes, first_token_only=True)
    assert colocated.prefill is None and conditional.route(list(range(200, 240)), [], decodes).num_uncached_tokens == 0


def test_prefix_aware_follows_the_cache_unless_that_engine_is_much_busier():
    aware = policy(prefill_policy="prefix_aware")
    p0, p1 = Link("p0", "prefill", queued_prefill_tokens=900), Link("p1", "prefill", open_tokens=10)
    decodes = [Link("d")]
    shared = list(range(64))
    assert aware.route(shared + [1], [p0, p1], decodes).prefill is p0, "no hit anywhere: least loaded (ledger)"
    p0.open_tokens = 500  # busier, but within the balance window
    assert aware.route(shared + [2], [p0, p1], decodes).prefill is p0, "the prefix lives on p0"
    p0.open_tokens = 10 + PREFIX_BALANCE_TOKENS + 1
    assert aware.route(shared + [3], [p0, p1], decodes).prefill is p1, "too busy: load wins"


def test_least_loaded_prefill_and_forgetting_an_engine():
    least = policy(prefill_policy="least_loaded")
    p0, p1 = Link("p0", "prefill", open_tokens=300), Link("p1", "prefill", queued_prefill_tokens=900)
    assert least.route(list(range(10)), [p0, p1], [Link("d")]).prefill is p1
    index = least.index(p1)
    assert index.num_matched_blocks(compute_block_hashes(list(range(10)), BLOCK)) == 2
    least.forget(p1)
    assert least.index(p1).num_matched_blocks(compute_block_hashes(list(range(10)), BLOCK)) == 0


def test_prefix_index_is_lru_bounded():
    index = PrefixIndex(capacity=3)
    hashes = compute_block_hashes(list(range(20)), BLOCK)  # 5 blocks
    index.add(hashes[:3])
    assert index.num_matched_blocks(hashes) == 3
    index.add(hashes[3:5])  # evicts the two oldest
    assert len(index) == 3 and index.num_matched_blocks(hashes) == 0
    assert index.num_matched_blocks(hashes[2:]) == 3


def test_a_finished_sequence_is_learnt_unless_its_engine_left():
    """The next chat turn (prompt + output + a new message) counts the whole finished sequence as cached on
    the decode engine that generated it, and prefills locally; a sequence finished on an engine that has left
    since teaches nothing."""
    learnt = policy(local_prefill_threshold=8)
    prefills, decode = [Link("p", "prefill")], Link("d")
    prompt, output = list(range(100, 120)), list(range(300, 320))
    learnt.record_output(decode, prompt + output)
    follow_up = learnt.route(prompt + output + [7] * 4, prefills, [decode])
    assert follow_up.num_uncached_tokens == 4 and follow_up.prefill is None
    left = Link("gone", up=False)
    learnt.record_output(left, prompt + output)
    assert learnt.index(left).num_matched_blocks(compute_block_hashes(prompt + output, BLOCK)) == 0


def test_a_finished_sequence_continues_the_hashes_its_route_computed():
    """record_output hashes only the output's blocks when given the route's prompt hashes, and learns the same
    blocks as hashing the whole sequence again."""
    prompt, output = list(range(100, 121)), list(range(300, 320))  # the prompt ends inside a block
    whole, continued = policy(), policy()
    whole_decode, continued_decode = Link("d"), Link("d")
    whole.record_output(whole_decode, prompt + output)
    route = continued.route(prompt, [], [continued_decode])
    continued.record_output(continued_decode, prompt + output, route.prompt_hashes)
    expected = compute_block_hashes(prompt + output, BLOCK)
    assert whole.index(whole_decode).num_matched_blocks(expected) == len(expected) == 10
    assert continued.index(continued_decode).num_matched_blocks(expected) == len(expected)
