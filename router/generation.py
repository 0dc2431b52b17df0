"""One choice of one request, end to end: pick engines, send the prompt to both at once, relay the
tokens as text, apply stop strings, and clean up.

    ChoiceRunner(gateway, spec, request_id).events()  ->  ChoiceDelta ... (the last has finish_reason)
    runner.start() sends the first attempt at once; events() then relays it (abandon() if it never will)

How one attempt's tokens are relayed (P's first token, D's stream, prompt logprobs) is router/relay.py's
state machine; this module sends attempts and retries them. The first token comes from the prefill engine
as soon as it is sampled; a choice with max_tokens=1 goes to the prefill engine alone (its first token is
the answer, and no KV moves); if the first token ends any other choice (a stop token, a stop string), the
decode engine is aborted and frees the blocks it reserved.

Failures, in order of preference:
  * an engine leaves routing (missed heartbeats, stopped) or cannot take the request before any
    token reached the client: submit again elsewhere (a new engine request id, at most max_retries);
    a failed prefill engine makes the retry prefill on the decode engine;
  * the decode engine rejects the request before any token: the client's fault, a 400 with its words;
  * an engine's step raised while running the request (error_code "engine_step_failed"): EngineFailed,
    never retried, since the request could take the next engine's step down the same way;
  * the decode engine is lost (it died, or stopped beating) after tokens were relayed: the choice
    migrates (router/migration.py): a new attempt on a decode engine goes on after those tokens, and
    the same relay continues the same stream;
  * anything else after tokens were streamed: EngineFailed. A non-streaming request has streamed nothing,
    so it may restart from scratch: `restartable` runners yield Restarted(index), and the caller
    drops what it gathered for that choice.
Whatever ends the choice (finish, stop string, error, the client leaving = the consumer closing the
generator), `Submission.close` runs and aborts the request on every engine still working on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pdserve.control.messages import Abort, FirstToken, GenerateRequest, PrefillRequest, TokenDelta
from pdserve.control.sampling_params import SamplingParams
from pdserve.router.choice import ChoiceDelta, ChoiceSpec, Restarted
from pdserve.router.errors import EngineFailed
from pdserve.router.link import EngineUnreachable
from pdserve.router.policies import Route
from pdserve.router.migration import Migration
from pdserve.router.relay import DEADLINE, Migrate, Relay, RelayState, Retry

log = logging.getLogger("pdserve.router.generation")

class _Inbox:
    """An attempt's incoming (source, item) pairs, for its one reader: a deque and the reader's waiter. Every
    streamed token passes through it, and an asyncio.Queue there cost twice the Python calls (issue #17)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[tuple[str, Any]] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, source: str, item: Any) -> None:
        self._items.append((source, item))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> tuple[str, Any]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class _Sink:
    """What an EngineLink puts deltas into: the attempt's inbox, each item tagged with the link's side."""

    __slots__ = ("inbox", "source")

    def __init__(self, inbox: _Inbox, source: str) -> None:
        self.inbox, self.source = inbox, source

    def put_nowait(self, item: Any) -> None:
        self.inbox.put(self.source, item)


class Submission:
    """One attempt of a choice on one route: the engine request and the streams that carry it."""

    def __init__(self, route: Route, request_id: str, deadline: float) -> None:
        self.route = route
        self.request_id = request_id
        self.inbox = _Inbox()
        self.finished = False  # the decode engine ended the request itself: nothing to abort
        self.decode_sent = False  # a choice that ends at the prefill engine's first token never goes to D
        self.prefill = route.prefill  # aborted too if D does not finish: it may hold the prompt's KV for D
        self.sampling_params: SamplingParams | None = None  # as sent (a migration sends the same seed again)
        # at the deadline (loop time) a timer puts (DEADLINE, None) in the inbox: one timer per attempt
        # rather than a timeout scope around every wait for a token
        self._timer = asyncio.get_running_loop().call_at(deadline, self.inbox.put, DEADLINE, None)
        local_tokens = route.num_uncached_tokens if route.prefill is None else 0  # the prompt D computes itself
        route.decode.open_stream(request_id, _Sink(self.inbox, "decode"), route.num_prompt_tokens,
                                 num_prefill_tokens=local_tokens)
        if route.prefill is not None:
            route.prefill.open_stream(request_id, _Sink(self.inbox, "prefill"), route.num_uncached_tokens,
                                      num_prefill_tokens=route.num_uncached_tokens, decodes=False)

    def submit(self, spec: ChoiceSpec) -> None:
        """Send the prompt to the prefill and the decode engine at once (EngineUnreachable -> Retry)."""
        decode, prefill = self.route.decode, self.route.prefill
        prompt = tuple(spec.prompt_token_ids)
        params = spec.sampling_params
        if prefill is not None:
            params = _one_seed_for_both(params)
            try:
                prefill.send(PrefillRequest(request_id=self.request_id, prompt_token_ids=prompt,
                                            sampling_params=params))
            except EngineUnreachable as exc:
                raise Retry(str(exc), exclude=prefill.control_address) from exc
        if prefill is not None and params.max_tokens == 1:  # as Gateway.route's first_token_only
            return  # the prefill engine's first token is the whole answer: no KV needs to move
        kv_address = prefill.info.kv_address if prefill is not None else None
        try:
            decode.send(GenerateRequest(request_id=self.request_id, prompt_token_ids=prompt,
                                        sampling_params=params, prefill_kv_address=kv_address))
        except EngineUnreachable as exc:
            raise Retry(str(exc), exclude=decode.control_address) from exc
        self.decode_sent = True
        self.sampling_params = params

    def resume(self, spec: ChoiceSpec, params: SamplingParams, token_ids: list[int]) -> None:
        """A migration: the prompt to the decode engine, which prefills it with `token_ids` (the output the client
        has) and goes on after them. Its prompt logprobs were sent with the first token."""
        params = params.replace(prompt_logprobs=None)
        try:
            self.route.decode.send(GenerateRequest(request_id=self.request_id, prompt_token_ids=tuple(spec.prompt_token_ids),
                                                   sampling_params=params, resume_token_ids=tuple(token_ids)))
        except EngineUnreachable as exc:
            raise Retry(str(exc), exclude=self.route.decode.control_address) from exc
        self.decode_sent = True
        self.sampling_params = params

    def keep_first_token(self, delta: TokenDelta) -> None:
        """The prefill engine's first token is the client's: the decode engine continues from it, and
        emits it (rather than its own sample) if it ends up prefilling the prompt itself."""
        self.route.decode.try_send(FirstToken(request_id=self.request_id, token_id=delta.token_ids[0],
                                              logprobs=delta.logprobs[0] if delta.logprobs else None))

    def release_prefill(self) -> None:
        """Tokens flow (the prefill engine's first one, or the decode engine's): the prefill engine's part
        is over for the router, whatever becomes of its KV (that is between the two engines)."""
        if self.route.prefill is not None:
            self.route.prefill.close_stream(self.request_id)
            self.route = Route(self.route.decode, None, self.route.num_uncached_tokens, self.route.prompt_hashes)

    def close(self) -> None:
        self._timer.cancel()
        for link in filter(None, (self.route.decode, self.route.prefill)):
            link.close_stream(self.request_id)
        if self.finished:
            return
        # P too once its part is over: a D that is gone or aborted no longer asks for the KV it keeps
        for link in filter(None, (self.route.decode if self.decode_sent else None, self.prefill)):
            link.try_send(Abort(request_id=self.request_id, reason="the router ended the request"))


class ChoiceRunner:
    def __init__(self, gateway: Any, spec: ChoiceSpec, request_id: str, *, deadline: float,
                 restartable: bool = False) -> None:
        self.gateway = gateway  # router.gateway.Gateway
        self.spec = spec
        self.request_id = request_id
        self.deadline = deadline  # loop time
        self.restartable = restartable
        self._started: Submission | Retry | None = None  # the first attempt, once start() sent it

    def start(self) -> None:
        """Send the first attempt to the engines now, so that they work while the caller builds its
        response; `events()` relays it. Raises what routing raises (no engine: a 503). If `events()` is
        never iterated, `abandon()` aborts what was sent."""
        try:
            self._started = self._submit(0, set(), False)
        except Retry as exc:  # events() retries it
            self._started = exc

    def abandon(self) -> None:
        """Abort the attempt `start()` sent if `events()` never took it over (the caller gave up first)."""
        started, self._started = self._started, None
        if isinstance(started, Submission):
            started.close()

    def _submit(self, attempt: int, excluded: set[str], force_local: bool) -> Submission:
        route = self.gateway.route(self.spec.prompt_token_ids, excluded, force_local,
                                   first_token_only=self.spec.sampling_params.max_tokens == 1)
        submission = Submission(route, f"{self.request_id}-{self.spec.index}.{attempt}", self.deadline)
        try:
            submission.submit(self.spec)
        except BaseException:
            submission.close()
            raise
        return submission

    def _first_submission(self) -> Submission:
        """The attempt `start()` sent (or its failure, raised here), or a new one."""
        started, self._started = self._started, None
        if isinstance(started, Retry):
            raise started
        return started or self._submit(0, set(), False)

    async def events(self) -> AsyncIterator[ChoiceDelta | Restarted]:
        attempt, force_local, excluded = 0, False, set()
        relay: Relay | None = None  # kept across a migration, which continues its stream
        migration = Migration(self.gateway, self.request_id, self.deadline)
        while True:
            emitted, retry = False, None
            submission: Submission | None = None
            try:
                if relay is not None and relay.state is RelayState.MIGRATING:
                    submission = await migration.resume(relay, self._resumer(relay, attempt))
                else:
                    submission = (self._first_submission() if attempt == 0
                                  else self._submit(attempt, excluded, force_local))
                    relay = self._new_relay(submission)
                async for delta in self._relay(relay):
                    emitted = True
                    yield delta
                return
            except Migrate as exc:
                log.warning("request %s choice %d: %s; migrating", self.request_id, self.spec.index, exc)
                migration.lose(exc)
                attempt += 1
                continue
            except Retry as exc:
                retry = exc
            finally:
                if submission is not None:
                    submission.close()
            if attempt >= self.gateway.config.max_retries or (emitted and not self.restartable):
                raise EngineFailed(f"the request failed and cannot be retried: {retry}")
            log.warning("request %s choice %d: %s; retrying", self.request_id, self.spec.index, retry)
            attempt += 1
            force_local = force_local or retry.force_local
            if retry.exclude:
                excluded.add(retry.exclude)
            if emitted:
                yield Restarted(self.spec.index)

    def _resumer(self, relay: Relay, attempt: int) -> Callable[[Route], Submission]:
        """What a migration calls with the route it found: a new attempt that goes on after the relay's tokens."""
        params = relay.submission.sampling_params or self.spec.sampling_params

        def submit(route: Route) -> Submission:
            submission = Submission(route, f"{self.request_id}-{self.spec.index}.{attempt}", self.deadline)
            try:
                submission.resume(self.spec, params, relay.token_ids)
            except BaseException:
                submission.close()
                raise
            return submission

        return submit

    def _new_relay(self, submission: Submission) -> Relay:
        detokenizer = self.gateway.tokenization.detokenizer(self.spec.prompt_token_ids, self.spec.sampling_params)
        relay = Relay(self.spec, submission, detokenizer)
        if relay.waits_for_shared_rows:
            self.spec.shared_prompt_logprobs.notify(submission.inbox)
        return relay

    async def _relay(self, relay: Relay) -> AsyncIterator[ChoiceDelta]:
        submission = relay.submission
        while relay.state is not RelayState.FINISHED:
            source, item = await submission.inbox.get()
            for delta in relay.receive(source, item):
                if delta.finish_reason is not None:  # the prefix index learns the output after the answer is written
                    self._record_output(submission, relay.token_ids)
                yield delta

    def _record_output(self, submission: Submission, token_ids: list[int]) -> None:
        if submission.decode_sent:
            asyncio.get_running_loop().call_soon(self.gateway.policy.record_output, submission.route.decode,
                                                 self.spec.prompt_token_ids + token_ids, submission.route.prompt_hashes)


def _one_seed_for_both(params: SamplingParams) -> SamplingParams:
    """An unseeded random choice sent to two engines gets a random seed, so that a decode engine that
    samples the first token itself (it prefills locally, before the prefill engine's FirstToken has come)
    draws the same token as the prefill engine (stateless seeds: docs/serving/sampling.md)."""
    if params.seed is not None or params.temperature == 0:
        return params
    return params.replace(seed=random.getrandbits(63))


def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come; the first error cancels the rest. One stream is
    returned as it is (no generator in between: every token of every n=1 request passes here)."""
    return streams[0] if len(streams) == 1 else _merge_many(streams)


async def _merge_many(streams: list[AsyncIterator]) -> AsyncIterator:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((item, None))
            queue.put_nowait((done, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((done, exc))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
