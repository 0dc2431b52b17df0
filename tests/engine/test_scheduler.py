"""Scheduler behaviour without a model: a fake runner samples fixed tokens, a fake connector plays
the remote side. Every scenario ends with all blocks back in the pool."""

from __future__ import annotations

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import ConnectorEvents, KVConnector
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.scheduler import KVFailurePolicy, Scheduler

BLOCK = 4
EOS = 99


def make_request(request_id: str, num_prompt: int, max_tokens: int = 4, **params) -> Request:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    prompt = [(int(request_id, 36) * 7 + i) % 50 + 1 for i in range(num_prompt)]
    return Request(request_id, prompt, sampling, eos_token_id=EOS, max_tokens=max_tokens)


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=16, connector=None, **kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, kv, max_model_len=256, connector=connector, **kwargs)


def step(scheduler: Scheduler, token: int = 7):
    plan = scheduler.schedule()
    sampled = {s.request.request_id: (token, None) for s in plan.scheduled if s.samples}
    return plan, scheduler.update_from_output(plan, sampled)


def run_to_end(scheduler: Scheduler, max_steps: int = 200) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_work():
            return deltas
        _, produced = step(scheduler)
        for delta in produced:
            deltas.setdefault(delta.request_id, []).append(delta)
    raise AssertionError("scheduler did not drain: a request hangs")


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    assert not scheduler.has_work()
    assert scheduler.kv.num_used_blocks == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    scheduler.kv.check_invariants()


def test_decodes_first_and_budget_respected():
    scheduler = make_scheduler(budget=10)
    for rid, n in [("a", 3), ("b", 5)]:
        scheduler.add_request(make_request(rid, n))
    plan, _ = step(scheduler)
    assert [s.num_new_tokens for s in plan.scheduled] == [3, 5]
    scheduler.add_request(make_request("c", 9))
    plan, _ = step(scheduler)
    # two decodes first, then as much of c's prompt as the budget leaves
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 1), ("c", 8)]
    assert plan.num_decodes == 2 and plan.num_tokens == 10
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


def test_chunked_prefill_samples_only_after_last_chunk():
    scheduler = make_scheduler(budget=8)
    request = make_request("a", 20, max_tokens=2)
    scheduler.add_request(request)
    chunks = []
    for _ in range(3):
        plan, deltas = step(scheduler)
        chunks.append(plan.scheduled[0].num_new_tokens)
        assert bool(deltas) == (len(chunks) == 3)
    assert chunks == [8, 8, 4]
    assert request.num_computed_tokens == 20 and request.output_token_ids == [7]
    run_to_end(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert_scheduler_empty(scheduler)


def test_preemption_recomputes_and_finishes_everything():
    scheduler = make_scheduler(num_blocks=6)  # 24 token slots for 3 requests of up to 14 tokens
    requests = [make_request(rid, 6, max_tokens=8) for rid in "abc"]
    for request in requests:
        scheduler.add_request(request)
    deltas = run_to_end(scheduler)
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == [7] * 8
        assert sum(len(d.token_ids) for d in deltas[request.request_id]) == 8
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("stage", ["waiting", "running"])
def test_abort_frees_blocks(stage):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9, max_tokens=50))
    if stage == "running":
        step(scheduler)
        assert scheduler.kv.num_used_blocks > 0
    assert scheduler.abort("a")
    assert not scheduler.abort("a"), "a second abort of the same id is a no-op"
    _, deltas = step(scheduler)
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", "abort")]
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize(
    "params, tokens, expected_outputs, reason",
    [
        ({}, [5, EOS], 2, "stop"),
        ({"ignore_eos": True}, [5, EOS, 6, 6], 4, "length"),
        ({"min_tokens": 3}, [EOS, EOS, EOS], 3, "stop"),
        ({"stop_token_ids": (42,)}, [5, 42], 2, "stop"),
    ],
)
def test_stop_conditions(params, tokens, expected_outputs, reason):
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=4, **params)
    scheduler.add_request(request)
    for token in tokens:
        if not scheduler.has_work():
            break
        step(scheduler, token)
    assert request.num_output_tokens == expected_outputs
    assert request.status.finish_reason() == reason
    assert_scheduler_empty(scheduler)


class FakeConnector(KVConnector):
    """Decode role: every prompt's KV beyond the local hit comes from a peer; tests decide when it lands."""

    def __init__(self, delay_free: bool = False) -> None:
        self.asked: dict[str, tuple[list[int], int]] = {}
        self.events = ConnectorEvents()
        self.delay_free = delay_free
        self.aborted: list[str] = []

    def num_external_tokens(self, request, num_local_hit_tokens):
        return request.num_prompt_tokens - num_local_hit_tokens

    def on_blocks_allocated(self, request, block_ids, num_external_tokens):
        self.asked[request.request_id] = (block_ids, num_external_tokens)

    def on_request_finished(self, request, block_ids):
        return self.delay_free

    def on_request_aborted(self, request):
        self.aborted.append(request.request_id)

    def poll(self):
        events, self.events = self.events, ConnectorEvents()
        return events


def test_remote_kv_parks_request_then_decodes():
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    request = make_request("a", 10, max_tokens=3)
    scheduler.add_request(request)
    plan, _ = step(scheduler)
    assert plan.is_empty and request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    block_ids, num_external = connector.asked["a"]
    assert num_external == 10 and len(block_ids) == 3
    assert scheduler.kv.pool.num_cached_blocks == 0, "blocks being filled must not be published yet"
    connector.events.received["a"] = (11, None)
    plan, deltas = step(scheduler)
    assert [list(d.token_ids) for d in deltas][0] == [11], "the remote first token is reported first"
    assert request.num_computed_tokens >= 10 and scheduler.kv.pool.num_cached_blocks == 2
    run_to_end(scheduler)
    assert request.output_token_ids == [11, 7, 7]
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("policy", list(KVFailurePolicy))
def test_remote_kv_failure_policy(policy):
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector, kv_failure_policy=policy)
    request = make_request("a", 10, max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)
    connector.events.failed["a"] = "peer died"
    deltas = run_to_end(scheduler)
    if policy is KVFailurePolicy.RECOMPUTE:
        assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == [7, 7]
    else:
        assert request.status is RequestStatus.FINISHED_ERROR
        assert "peer died" in deltas["a"][-1].error
    assert_scheduler_empty(scheduler)


def test_abort_while_waiting_for_remote_kv_tells_connector():
    connector = FakeConnector()
    scheduler = make_scheduler(connector=connector)
    scheduler.add_request(make_request("a", 10))
    step(scheduler)
    scheduler.abort("a")
    assert connector.aborted == ["a"]
    connector.events.received["a"] = (3, None)  # a late arrival for a dead request is ignored
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)


def test_delayed_free_keeps_blocks_until_sent():
    class ProducerConnector(FakeConnector):
        def num_external_tokens(self, request, num_local_hit_tokens):
            return 0

    connector = ProducerConnector(delay_free=True)
    scheduler = make_scheduler(connector=connector)
    scheduler.add_request(make_request("a", 9, max_tokens=1))
    step(scheduler)
    assert scheduler.kv.num_used_blocks == 3, "blocks stay until the peer has the KV"
    connector.events.sent.add("a")
    step(scheduler)
    assert_scheduler_empty(scheduler)


class FakePrefillConnector(FakeConnector):
    """Prefill role: prompts are computed here; a finished one's blocks wait for the peer."""

    def __init__(self) -> None:
        super().__init__(delay_free=True)

    def num_external_tokens(self, request, num_local_hit_tokens):
        return 0

    def on_request_finished(self, request, block_ids):
        return request.status is not RequestStatus.FINISHED_ABORTED


def test_abort_of_a_finished_request_frees_the_blocks_held_for_the_peer():
    connector = FakePrefillConnector()
    scheduler = make_scheduler(connector=connector)
    scheduler.add_request(make_request("a", 9, max_tokens=1))
    step(scheduler)
    assert scheduler.kv.num_used_blocks == 3
    assert scheduler.abort("a") and connector.aborted == ["a"]
    assert not scheduler.abort("a")
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("held", [False, True])
def test_an_abort_event_ends_the_request_computing_or_held(held):
    """Prefill role: the peer gave up on a request, whether it still computes or its blocks are held."""
    connector = FakePrefillConnector()
    scheduler = make_scheduler(connector=connector, budget=4)
    scheduler.add_request(make_request("a", 9 if not held else 3, max_tokens=1))
    step(scheduler)
    assert (scheduler.kv.num_used_blocks > 0) and (("a" in scheduler.delayed_free) is held)
    connector.events.aborted.add("a")
    _, deltas = step(scheduler)
    assert [(d.request_id, d.finish_reason) for d in deltas] == ([] if held else [("a", "abort")])
    assert connector.aborted == ["a"]
    assert_scheduler_empty(scheduler)


def test_prefix_cache_lookups_are_counted():
    scheduler = make_scheduler()
    prompt = list(range(1, 11))  # 10 tokens: two full blocks of 4 and a partial one
    params = SamplingParams(temperature=0, max_tokens=2)
    scheduler.add_request(Request("first", prompt, params, eos_token_id=EOS, max_tokens=2))
    run_to_end(scheduler)
    assert (scheduler.prefix_cache_stats.queries, scheduler.prefix_cache_stats.hits) == (10, 0)
    scheduler.add_request(Request("second", prompt, params, eos_token_id=EOS, max_tokens=2))
    run_to_end(scheduler)
    # the two full blocks come from the cache; the partial block is never cached
    assert (scheduler.prefix_cache_stats.queries, scheduler.prefix_cache_stats.hits) == (20, 8)
    assert_scheduler_empty(scheduler)



def test_a_failed_step_ends_its_requests_and_unpublishes_only_the_blocks_it_was_to_compute():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9))  # two full blocks and one partial
    step(scheduler)  # a's prompt is computed: its two full blocks are in the prefix cache
    scheduler.add_request(make_request("b", 9))  # another prompt: publishes two blocks for the next step
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["a", "b"]
    deltas = scheduler.fail_step(plan, "the step raised")
    assert {d.request_id: (d.finish_reason, d.error_code, d.error) for d in deltas} == {
        rid: ("error", "engine_step_failed", "the step raised") for rid in ("a", "b")}
    assert_scheduler_empty(scheduler)
    for rid, num_hit in [("a", 8), ("b", 0)]:  # a's KV came from a step that worked; b's never came
        hits_before = scheduler.prefix_cache_stats.hits
        scheduler.add_request(make_request(rid, 9))
        scheduler.schedule()
        assert scheduler.prefix_cache_stats.hits - hits_before == num_hit, rid
    run_to_end(scheduler)
    assert_scheduler_empty(scheduler)
