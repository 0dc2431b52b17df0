"""One engine: scheduler + KV cache manager + model runner, driven one step at a time. No sockets: a
KV connector's scheduler side goes to the scheduler, its transfer side only lends the per-layer hook."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from pdserve.control.messages import TokenDelta
from pdserve.engine import prompt_logprobs
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVConnector, KVTransferSide
from pdserve.engine.layers.attention import shared_sliding_window
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import InvalidRequestError, Request, RequestStatus, SamplingParams
from pdserve.engine.scheduler import KVFailurePolicy, Scheduler
from pdserve.engine.stats import SchedulerStats
from pdserve.engine.step_times import StepTimer
from pdserve.engine.structured_output import PendingConstraints, StructuredOutputCompiler, advance_over_output

log = logging.getLogger("pdserve.engine")


class EngineCore:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig = CacheConfig(),
        scheduler_config: SchedulerConfig = SchedulerConfig(),
        device: str = "cpu",
        connector: KVConnector | None = None,
        kv_failure_policy: KVFailurePolicy | str = KVFailurePolicy.RECOMPUTE,
        kv_transfer: KVTransferSide | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        # Sliding and full layers keep a block table per layer group on every engine; the KV link reads and
        # writes each layer through its group's table (docs/design/kv-link.md).
        self.runner = ModelRunner(model_config, cache_config, device, max_num_seqs=scheduler_config.max_num_seqs)
        windows = [w for w in map(model_config.sliding_window_of, range(model_config.num_layers)) if w is not None]
        self.kv_cache_manager: KVCacheManager | HybridKVCacheManager
        if self.runner.kv_groups is not None:
            self.kv_cache_manager = HybridKVCacheManager(
                self.runner.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                self.runner.kv_groups.windows)
        else:
            self.kv_cache_manager = KVCacheManager(
                self.runner.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                shared_sliding_window(self.runner.model), min(windows, default=None) if connector is not None else None,
            )
        self._max_chunk_tokens = scheduler_config.max_num_batched_tokens
        self.scheduler = Scheduler(
            scheduler_config, self.kv_cache_manager, model_config.max_model_len, connector, kv_failure_policy
        )
        self.kv_transfer = kv_transfer or KVTransferSide()
        self.kv_transfer.bind_kv_groups(self.runner.kv_groups)
        self.structured_output = StructuredOutputCompiler(model_config.model_dir, model_config.vocab_size)
        self.compiling = PendingConstraints(self.structured_output)  # requests whose large constraint compiles
        self._stepped_empty = False  # the last step scheduled nothing (has_runnable_work)
        self._compile_deltas: list[TokenDelta] = []  # aborts of compiling requests, sent with the next step
        self.step_timer = StepTimer()  # recent steps' measured times (EngineStats.step_times)

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     resume_token_ids: Sequence[int] = (), prefill_kv_address: str | None = None) -> Request:
        """Validate a request against this model and fill in what the model decides (eos, max_tokens).
        resume_token_ids: output the request already has (a migrated request, GenerateRequest's field).
        prefill_kv_address: the prefill engine whose KV link sends the prompt's KV (decode role), or None."""
        config = self.model_config
        if params.n != 1:  # an engine samples once per request: n is fanned out before (router, LLM)
            raise InvalidRequestError(f"n={params.n}: an engine request samples one sequence; send n requests of n=1")
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < config.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
        biased = next((t for t, _ in params.logit_bias if t >= config.vocab_size), None)
        if biased is not None:
            raise InvalidRequestError(f"logit_bias names token id {biased}, outside the vocabulary "
                                      f"[0, {config.vocab_size}): bias token ids of this model's tokenizer")
        max_tokens = params.max_tokens if params.max_tokens is not None else config.max_model_len - num_prompt
        if num_prompt + max(max_tokens, 1) > config.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the model's context "
                f"length of {config.max_model_len} tokens: shorten the prompt or lower max_tokens"
            )
        max_chunk_tokens = self._check_fits_cache(num_prompt + max_tokens, prefill_kv_address is not None)
        eos, *extra_eos = config.eos_token_ids or (None,)
        if extra_eos and not params.ignore_eos:  # e.g. Llama 3's <|eot_id|> beside <|end_of_text|>
            params = params.replace(stop_token_ids=params.stop_token_ids + tuple(extra_eos))
        request = Request(request_id, list(prompt_token_ids), params, eos_token_id=eos, max_tokens=max_tokens,
                          prefill_kv_address=prefill_kv_address, max_chunk_tokens=max_chunk_tokens)
        if resume_token_ids:
            resume_output(request, resume_token_ids, config.vocab_size)
        if self.structured_output.compiles_at_once(params):  # else add_request compiles it on a thread
            request.grammar = self.structured_output.grammar_state(params)
            advance_over_output(request)
        return request

    def _check_fits_cache(self, num_tokens: int, prompt_arrives: bool) -> int | None:
        """Refuse a request that would not fit the whole KV cache alone. prompt_arrives: its prompt's KV comes
        whole from a prefill engine, so it computes one token a step. Returns the most tokens a step may compute
        for it, should it prefill here after all (a failed transfer, a preemption); None: the step's budget."""
        manager = self.kv_cache_manager
        if isinstance(manager, HybridKVCacheManager):  # every layer group's table, a sliding one's window only
            if prompt_arrives:
                needed = manager.max_blocks_held_received(num_tokens)
            else:
                needed = manager.max_blocks_held(num_tokens, self._max_chunk_tokens)
            if needed > self.runner.num_blocks:
                raise InvalidRequestError(
                    f"the request needs up to {needed} KV blocks across the model's layer groups but the whole "
                    f"cache holds {self.runner.num_blocks}: lower max_tokens or start the engine with a larger "
                    "KV cache")
            if not prompt_arrives:
                return None
            chunk = manager.largest_chunk_held(num_tokens, self._max_chunk_tokens)
            return chunk if chunk < self._max_chunk_tokens else None
        capacity = self.runner.num_blocks * self.cache_config.block_size
        if num_tokens > capacity:
            raise InvalidRequestError(
                f"the request needs up to {num_tokens} tokens of KV cache but the whole cache holds {capacity}: "
                "lower max_tokens or start the engine with a larger KV cache"
            )
        return None

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_kind is not None and request.grammar is None:
            if request.request_id in self.scheduler.requests or self.compiling.get(request.request_id):
                raise ValueError(f"request id {request.request_id!r} is already in use: ids must be unique")
            self.compiling.start(request)  # joins the scheduler when its matcher is made (_admit_compiled)
            return
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        if self.compiling.abort(request_id):
            self._compile_deltas.append(TokenDelta(request_id=request_id, finish_reason="abort"))
            return True
        return self.scheduler.abort(request_id)

    def _admit_compiled(self) -> list[TokenDelta]:
        """Requests whose constraint compiled join the scheduler; one that did not compile fails as an
        invalid request (the client's 400). Returns the deltas to send (aborts of compiling requests too)."""
        deltas, self._compile_deltas = self._compile_deltas, []
        for request, error in self.compiling.take_ready():
            if error is None:
                self.scheduler.add_request(request)
            else:
                code = "invalid_request" if isinstance(error, InvalidRequestError) else "internal_error"
                deltas.append(TokenDelta(request_id=request.request_id, finish_reason="error", error=str(error),
                                         error_code=code))
        return deltas

    def keep_first_token(self, request_id: str, token_id: int, logprobs: dict[int, float] | None) -> None:
        """The first token was sampled elsewhere (a prefill engine) and sent to the client: a request that
        has no output yet emits it as its first token instead of sampling one."""
        request = self.scheduler.requests.get(request_id) or self.compiling.get(request_id)
        if request is not None and request.num_output_tokens == 0:
            request.prefill_first_token = (token_id, logprobs)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.compiling) or bool(self._compile_deltas)

    def take_prompt_logprobs(self) -> list[tuple[str, tuple]]:
        """(request id, its whole prompt's tables) of the prompts completed since the last call; each comes
        before the request's first token is reported (engine/prompt_logprobs.py)."""
        return [(request_id, prompt_logprobs.join(parts)) for request_id, parts in self.scheduler.take_prompt_logprobs()]

    def has_runnable_work(self) -> bool:
        """Requests that a step can advance now: not only ones waiting on a peer, and not only queued ones
        that the last step could not admit (no free KV blocks while the engine holds computed prompts for
        their decode engines). Then the engine loop waits for input (bounded) instead of stepping empty
        steps in a tight loop, which took a core from the other engine on the same machine."""
        return bool(self.scheduler.waiting or self.scheduler.running) and not self._stepped_empty

    def step(self) -> list[TokenDelta]:
        """Schedule, run the model once, and report every request's new tokens and endings. A model
        or sampler error fails the step's requests only (traceback logged); the engine goes on."""
        admitted = self._admit_compiled() if self.compiling or self._compile_deltas else []
        plan = self.scheduler.schedule()
        self._stepped_empty = plan.is_empty and not plan.preempted_ids  # a preemption frees blocks for the next
        if plan.is_empty:
            return admitted + self.scheduler.take_pending()
        label = _step_label(plan) if log.isEnabledFor(logging.DEBUG) else ""
        log.debug("%s began at %.6f", label, time.time())
        features, started = self.step_timer.features(plan), time.perf_counter()
        try:
            output = self.runner.execute(plan, self.kv_transfer.layer_hook(plan))
        except Exception as exc:  # noqa: BLE001 - one bad step must not end the engine, see docstring
            request_ids = [item.request.request_id for item in plan.scheduled]
            log.exception("a step failed; failing its requests %s", request_ids)
            return admitted + self.scheduler.fail_step(plan, _step_error(exc))
        log.debug("%s ended at %.6f", label, time.time())
        self.step_timer.record(features, time.perf_counter() - started)
        return admitted + self.scheduler.update_from_output(plan, output.sampled, output.prompt_logprobs)

    def stats(self) -> SchedulerStats:
        scheduler = self.scheduler
        return SchedulerStats(
            num_waiting=len(scheduler.waiting) + len(self.compiling),
            num_running=len(scheduler.running),
            num_waiting_for_remote_kv=len(scheduler.waiting_for_remote_kv),
            kv_blocks_used=self.kv_cache_manager.num_used_blocks,
            kv_blocks_total=self.runner.num_blocks,
            queued_prefill_tokens=sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_stats.queries,
            prefix_cache_hits=scheduler.prefix_cache_stats.hits,
            step_times=self.step_timer.snapshot(),
        )

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        self.scheduler.finish_externally(request_id, status)


def resume_output(request: Request, token_ids: Sequence[int], vocab_size: int) -> None:
    """Give a migrated request the output it already has, checked: the engine then goes on after it."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"resume token id {bad} is outside the vocabulary [0, {vocab_size})")
    if request.sampling_params.prompt_logprobs is not None:
        raise InvalidRequestError("a resumed request cannot ask for prompt_logprobs: they went out with its first "
                                  "token; send it without them")
    if len(token_ids) >= request.max_tokens:
        raise InvalidRequestError(f"the request resumes after {len(token_ids)} tokens but may have {request.max_tokens} "
                                  "(max_tokens): nothing is left to generate")
    for token_id in token_ids:
        request.append_output_token(token_id)


def _step_label(plan) -> str:
    """How the DEBUG log names a step: its tokens and the requests it prefills (tools match the engines'
    own timestamps of a step against other events, e.g. tests/decode/test_mid_step_kv.py)."""
    prompt_ids = [item.request.request_id for item in plan.scheduled[plan.num_decodes:]]
    return f"step of {plan.num_tokens} tokens (prompt chunks of {','.join(prompt_ids) or 'none'})"


def _step_error(exc: Exception) -> str:
    """What a request's client is told when the step it was in raised `exc`."""
    return (f"the engine failed while running this request ({type(exc).__name__}: {str(exc)[:300]}); it was "
            "not retried elsewhere since it may fail there too: change its sampling parameters or prompt, "
            "or report the error to the operator if it recurs")
