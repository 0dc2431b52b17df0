"""Continuous batching with chunked prefill, prefix caching, preemption by recompute and KV-connector
hooks. Torch-free: it decides which tokens of which requests run in the next step; the model runner
turns that plan into tensors.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from pdserve.control.messages import TokenDelta
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.stats import PrefixCacheStats


class KVFailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"  # prefill locally when external KV does not arrive
    FAIL = "fail"  # end the request with an error


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) run this step
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so the step yields a new token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes (one new token) first, then prefill chunks
    num_decodes: int
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        connector: KVConnector | None = None,
        kv_failure_policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.connector = connector or KVConnector()
        self.kv_failure_policy = KVFailurePolicy(kv_failure_policy)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote_kv: dict[str, Request] = {}
        self.delayed_free: dict[str, Request] = {}  # finished, blocks held until the peer has them
        self._pending: list[TokenDelta] = []  # produced outside a step (connector events, aborts)
        self._prompt_logprobs_ready: list[tuple[str, list]] = []  # (request id, its prompt's chunks' tables)
        self.num_preemptions = 0  # since start, for stats and tests
        self.admission_blocked = False  # the last schedule left a queued request out for want of KV blocks
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use: ids must be unique")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """End a request at any stage and free its blocks. Returns False for an unknown id."""
        request = self.requests.get(request_id)
        if request is None:
            return self._abort_delayed_free(request_id)
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.waiting_for_remote_kv.pop(request_id, None)
        self.connector.on_request_aborted(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def _abort_delayed_free(self, request_id: str) -> bool:
        """A finished request whose blocks wait for the peer: the peer will not take them now."""
        request = self.delayed_free.pop(request_id, None)
        if request is None:
            return False
        self.connector.on_request_aborted(request)
        self.kv.free(request)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote_kv)

    def has_work(self) -> bool:
        return bool(self.num_unfinished or self._pending or self.delayed_free)

    def waits_for_blocks(self, request_id: str) -> bool:
        """Whether this request is queued behind the last schedule's want of free KV blocks."""
        request = self.requests.get(request_id)
        return (self.admission_blocked and request is not None
                and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED))

    # ---- planning a step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._apply_connector_events()
        self.admission_blocked = False
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens != 1]
        return SchedulerOutput(decodes + prefills, len(decodes), [r.request_id for r in preempted])

    def _chunk(self, request: Request, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_tokens = min(num_tokens, threshold)
        if request.max_chunk_tokens is not None:
            num_tokens = min(num_tokens, request.max_chunk_tokens)
        return min(num_tokens, budget)

    def _schedule_running(self, budget: int, scheduled: list, preempted: list) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # the newest request yields first
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return budget
            scheduled.append(ScheduledRequest(request, num_new, self.kv.get_block_ids(request.request_id)))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_external = 0
            if request.allow_remote_prefill and request.num_output_tokens == 0:
                num_external = self.connector.num_external_tokens(request, num_hit)
            if num_external > 0:
                if not self._start_remote_prefill(request, hit_blocks, num_hit, num_external):
                    self.admission_blocked = True
                    return
                continue
            num_new = self._chunk(request, request.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(request, num_new, num_hit, hit_blocks) is None:
                self.admission_blocked = True
                return
            self.waiting.popleft()
            self._count_prefix_lookup(request, num_hit)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, self.kv.get_block_ids(request.request_id)))
            budget -= num_new

    def _count_prefix_lookup(self, request: Request, num_hit: int) -> None:
        """One admission's prefix-cache lookup (a preempted request looks up again when readmitted)."""
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit

    def _start_remote_prefill(self, request: Request, hit_blocks: list, num_hit: int, num_external: int) -> bool:
        """Allocate blocks for KV that a prefill engine will send, and park the request until it lands."""
        blocks = self.kv.allocate_slots(
            request, 0, num_hit, hit_blocks, num_external_computed_tokens=num_external, delay_cache_blocks=True
        )
        if blocks is None:
            return False
        self.waiting.popleft()
        self._count_prefix_lookup(request, num_hit)
        request.num_computed_tokens = num_hit
        request.num_cached_tokens = num_hit
        request.num_external_computed_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[request.request_id] = request
        self.connector.on_blocks_allocated(request, self.kv.get_block_ids(request.request_id), num_external)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after a step --------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, tuple[int, dict[int, float] | None]],
        prompt_tables: dict | None = None,
    ) -> list[TokenDelta]:
        """Advance each scheduled request by its tokens, append sampled tokens, finish what stopped.
        prompt_tables: the step's prompt-logprob tables by request id; a prompt's whole set is ready
        (take_prompt_logprobs) once its last chunk ran, before its first token's delta is sent."""
        deltas, self._pending = self._pending, []
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            if prompt_tables and request.request_id in prompt_tables:
                parts = request.add_prompt_logprobs(prompt_tables[request.request_id])
                if parts is not None:
                    self._prompt_logprobs_ready.append((request.request_id, parts))
            if request.request_id not in sampled:
                continue
            token_id, logprobs = sampled[request.request_id]
            if request.num_output_tokens == 0 and request.prefill_first_token is not None:
                token_id, logprobs = request.prefill_first_token  # the client has it: continue from it
            deltas.append(self._append_token(request, token_id, logprobs))
        return deltas

    def fail_step(self, output: SchedulerOutput, error: str) -> list[TokenDelta]:
        """The model step of `output` raised: end each of its requests with `error` (error_code
        "engine_step_failed", which the router does not retry) and free its blocks, whose KV for this
        step never becomes a prefix hit. Returns the deltas to send, pending ones included."""
        for item in output.scheduled:
            request = item.request
            self.running.remove(request)
            self.connector.on_request_aborted(request)  # a prefill stream of this step stops here
            self.kv.uncache_uncomputed(request)
            self._finish(request, RequestStatus.FINISHED_ERROR, error=error, error_code="engine_step_failed")
        return self.take_pending()

    def take_prompt_logprobs(self) -> list[tuple[str, list]]:
        ready, self._prompt_logprobs_ready = self._prompt_logprobs_ready, []
        return ready

    def take_pending(self) -> list[TokenDelta]:
        """Deltas produced without a model step (aborts, remote-KV failures) since the last call."""
        deltas, self._pending = self._pending, []
        return deltas

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None) -> TokenDelta:
        """The token's TokenDelta, as the engine loop sends it (prompt tokens from the prefix cache with
        the first token, the finish reason with the last)."""
        request.append_output_token(token_id)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        if request.grammar is not None and not request.grammar.accept(token_id):
            return self._fail_constraint(request, token_id)
        num_cached = max(request.num_cached_tokens, 0) if request.num_output_tokens == 1 else 0
        status = self._stop_status(request)
        # a complete constraint admits no more tokens: it ends the request, ahead of a length limit (a stop
        # token, which the constraint may take last, stays the reason)
        by_constraint = (status is not RequestStatus.FINISHED_STOPPED and request.grammar is not None
                         and request.grammar.is_complete)
        if by_constraint:
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.running.remove(request)
            self._finish(request, status, report=False)
        return TokenDelta(request_id=request.request_id, token_ids=(token_id,),
                          logprobs=(logprobs,) if logprobs is not None else (), num_cached_tokens=num_cached,
                          finish_reason=status.finish_reason() if status is not None else None,
                          stop_reason=request.stop_reason if status is not None else None,
                          stopped_by_constraint=by_constraint)

    def _fail_constraint(self, request: Request, token_id: int) -> TokenDelta:
        """A token the request's structured-output matcher refused (its matcher broke, or a peer's first
        token broke it): the request ends with the error."""
        broken = request.grammar.error  # the constraint hit a limit of its matcher: the request's own doing
        if broken:
            error = (f"the request's structured output failed after {request.num_output_tokens - 1} tokens: "
                     f"{broken.strip().splitlines()[0][:500]}; check the constraint, or simplify it")
        else:
            error = f"token {token_id} does not fit the request's structured output: report this to the operator"
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_ERROR, report=False, error=error)
        return TokenDelta(request_id=request.request_id, finish_reason="error", error=error,
                          error_code="invalid_request" if broken else "internal_error")

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, report: bool = True, error: str | None = None,
                error_code: str | None = None) -> None:
        request.status = status
        request.error = error
        self.requests.pop(request.request_id, None)
        if self.connector.on_request_finished(request, self.kv.get_block_ids(request.request_id)):
            self.delayed_free[request.request_id] = request
        else:
            self.kv.free(request)
        if report:
            if status is RequestStatus.FINISHED_ERROR and error_code is None:
                error_code = "internal_error"
            self._pending.append(TokenDelta(request_id=request.request_id, finish_reason=status.finish_reason(),
                                            error=error, error_code=error_code))

    def finish_externally(self, request_id: str, status: RequestStatus, error: str | None = None) -> bool:
        """End a running request for a reason found outside the model (e.g. a stop string matched)."""
        request = self.requests.get(request_id)
        if request is None or request not in self.running:
            return self.abort(request_id)
        self.running.remove(request)
        self._finish(request, status, report=False, error=error)
        return True

    # ---- KV connector events -------------------------------------------------------------------

    def _apply_connector_events(self) -> None:
        events = self.connector.poll()
        for request_id in events.sent:
            request = self.delayed_free.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
        for request_id, (first_token, logprobs) in events.received.items():
            self._on_remote_kv_received(request_id, first_token, logprobs)
        for request_id, reason in events.failed.items():
            self._on_remote_kv_failed(request_id, reason)
        for request_id in events.aborted:
            self.abort(request_id)

    def _on_remote_kv_received(self, request_id: str, first_token: int, logprobs: dict | None) -> None:
        request = self.waiting_for_remote_kv.pop(request_id, None)
        if request is None:
            return
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._pending.append(self._append_token(request, first_token, logprobs))

    def _on_remote_kv_failed(self, request_id: str, reason: str) -> None:
        request = self.waiting_for_remote_kv.pop(request_id, None)
        if request is None:
            return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_external_computed_tokens = 0
        if self.kv_failure_policy is KVFailurePolicy.RECOMPUTE:
            request.status = RequestStatus.WAITING
            request.allow_remote_prefill = False
            self.waiting.appendleft(request)
        else:
            self._finish(request, RequestStatus.FINISHED_ERROR, error=f"remote prefill failed: {reason}",
                         error_code="kv_transfer_failed")
