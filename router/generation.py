"""One choice of one request, end to end: pick engines, send the prompt to both at once, relay the
tokens as text, apply stop strings, and clean up.

    ChoiceRunner(gateway, spec, request_id).events()  ->  ChoiceDelta ... (the last has finish_reason)
    runner.start() sends the first attempt at once; events() then relays it (abandon() if it never will)

A choice that asks for prompt logprobs gathers the engine's PromptLogprobs (sent before its first token)
and hands them out with its first delta; with n > 1 only sample 0 asks the engines, and the prompt's
other samples wait for its set (SharedPromptLogprobs). A decode engine's first token that overtakes the
prefill engine's set (two sockets) waits for it; a first token without a whole set is the engine's fault:
EngineFailed, never an answer silently missing them.

The first token comes from the prefill engine as soon as it is sampled (before its KV moves) and is
streamed at once; the decode engine is told it (FirstToken) and its stream goes on from the second
token: its own first token, the same one, is dropped. A choice with max_tokens=1 goes to the prefill
engine alone (its first token is the answer, and no KV moves); if the first token ends any other choice
(a stop token, a stop string), the decode engine is aborted and frees the blocks it reserved. Whichever
engine's first token comes first is the choice's; the other engine's is not used.

Failures, in order of preference:
  * an engine leaves routing (missed heartbeats, stopped) or cannot take the request before any
    token reached the client: submit again elsewhere (a new engine request id, at most max_retries);
    a failed prefill engine makes the retry prefill on the decode engine;
  * the decode engine rejects the request before any token: the client's fault, a 400 with its words;
  * an engine's step raised while running the request (error_code "engine_step_failed"): EngineFailed,
    never retried, since the request could take the next engine's step down the same way;
  * anything after tokens were streamed: EngineFailed. A non-streaming request has streamed nothing,
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
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pdserve.control.errors import ProtocolError
from pdserve.control.messages import Abort, FirstToken, GenerateRequest, PrefillRequest, TokenDelta
from pdserve.control.prompt_logprobs import PositionLogprobs, PromptLogprobsAssembler
from pdserve.control.sampling_params import SamplingParams
from pdserve.router.errors import EngineFailed, InvalidRequest, RequestTimeout
from pdserve.router.link import EngineGone, EngineUnreachable, PromptLogprobsChunk
from pdserve.router.policies import Route

log = logging.getLogger("pdserve.router.generation")

_DEADLINE = "deadline"  # the source of the item an attempt's timer puts in its inbox


# A prompt's logprobs as the client gets them: [None, position 1, ..., position n - 1] (the first token has none)
PromptRows = list[PositionLogprobs | None]


class SharedPromptLogprobs:
    """The prompt logprobs of one prompt with n > 1 samples: sample 0 asks the engines and sets them, the
    other samples wait for them (each reports them)."""

    def __init__(self) -> None:
        self.rows: PromptRows | None = None
        self._ready = asyncio.Event()

    def set(self, rows: PromptRows) -> None:
        self.rows = rows
        self._ready.set()

    async def wait(self) -> PromptRows:
        await self._ready.wait()
        return self.rows


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # sent to the engines as it is; its stop strings are applied here
    prompt_only: bool = False  # max_tokens=0 with echo: the engines make one token, which is dropped
    shared_prompt_logprobs: SharedPromptLogprobs | None = None  # n > 1 and prompt logprobs asked: one per prompt

    @property
    def reports_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None or self.shared_prompt_logprobs is not None


@dataclass
class ChoiceDelta:
    """What one engine delta adds to a choice, as the client will see it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # the engine's prefix-cache hit, reported with the first token
    prompt_logprobs: PromptRows | None = None  # on the choice's first delta, when it asked for them


@dataclass(frozen=True)
class Restarted:
    """Yielded by a restartable runner that starts a choice over: drop what was gathered for it."""

    index: int


class _Retry(Exception):
    def __init__(self, reason: str, *, exclude: str | None = None, force_local: bool = False) -> None:
        super().__init__(reason)
        self.exclude = exclude
        self.force_local = force_local


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

    def put_back(self, items: list[tuple[str, Any]]) -> None:
        """Items its reader took out of turn go back to the front, in their order."""
        self._items.extendleft(reversed(items))

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
        # at the deadline (loop time) a timer puts (_DEADLINE, None) in the inbox: one timer per attempt
        # rather than a timeout scope around every wait for a token
        self._timer = asyncio.get_running_loop().call_at(deadline, self.inbox.put, _DEADLINE, None)
        route.decode.open_stream(request_id, _Sink(self.inbox, "decode"), route.num_prompt_tokens)
        if route.prefill is not None:
            route.prefill.open_stream(request_id, _Sink(self.inbox, "prefill"), route.num_uncached_tokens)

    def submit(self, spec: ChoiceSpec) -> None:
        """Send the prompt to the prefill and the decode engine at once (EngineUnreachable -> _Retry)."""
        decode, prefill = self.route.decode, self.route.prefill
        prompt = tuple(spec.prompt_token_ids)
        params = spec.sampling_params
        if prefill is not None:
            params = _one_seed_for_both(params)
            try:
                prefill.send(PrefillRequest(request_id=self.request_id, prompt_token_ids=prompt,
                                            sampling_params=params))
            except EngineUnreachable as exc:
                raise _Retry(str(exc), exclude=prefill.control_address) from exc
        if prefill is not None and params.max_tokens == 1:  # as Gateway.route's first_token_only
            return  # the prefill engine's first token is the whole answer: no KV needs to move
        kv_address = prefill.info.kv_address if prefill is not None else None
        try:
            decode.send(GenerateRequest(request_id=self.request_id, prompt_token_ids=prompt,
                                        sampling_params=params, prefill_kv_address=kv_address))
        except EngineUnreachable as exc:
            raise _Retry(str(exc), exclude=decode.control_address) from exc
        self.decode_sent = True

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
        self.token_ids: list[int] = []
        self._started: Submission | _Retry | None = None  # the first attempt, once start() sent it

    def start(self) -> None:
        """Send the first attempt to the engines now, so that they work while the caller builds its
        response; `events()` relays it. Raises what routing raises (no engine: a 503). If `events()` is
        never iterated, `abandon()` aborts what was sent."""
        try:
            self._started = self._submit(0, set(), False)
        except _Retry as exc:  # events() retries it
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
        if isinstance(started, _Retry):
            raise started
        return started or self._submit(0, set(), False)

    async def events(self) -> AsyncIterator[ChoiceDelta | Restarted]:
        attempt, force_local, excluded = 0, False, set()
        while True:
            emitted, retry = False, None
            submission: Submission | None = None
            try:
                submission = (self._first_submission() if attempt == 0
                              else self._submit(attempt, excluded, force_local))
                async for delta in self._relay(submission):
                    emitted = True
                    yield delta
                return
            except _Retry as exc:
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

    async def _relay(self, submission: Submission) -> AsyncIterator[ChoiceDelta]:
        detokenizer = self.gateway.tokenization.detokenizer(self.spec.prompt_token_ids, self.spec.sampling_params)
        self.token_ids = []
        first_token: int | None = None  # streamed from the prefill engine: the decode engine's first again
        pending = self.spec.reports_prompt_logprobs  # until the first token, which carries them
        gather = _PromptLogprobsGather(self.spec.prompt_token_ids) \
            if self.spec.sampling_params.prompt_logprobs is not None else None
        rows: PromptRows | None = None
        while True:
            source, item = await _next(submission.inbox)
            if source == "prefill" and self.token_ids:
                continue  # the decode engine's tokens came first: the prefill engine's part is over
            if type(item) is not TokenDelta:  # an engine gone, or a prompt's logprobs (before its first token)
                self._take_notice(submission, source, item, gather if pending else None)
                continue
            if item.finish_reason in ("error", "abort"):
                self._failed(source, item)
            if pending and (item.token_ids or item.finish_reason):  # the first token: the prompt's logprobs are in
                rows, pending = await self._prompt_rows(submission, gather, source), False
            if source == "prefill" and item.token_ids:
                first_token = item.token_ids[0]
                if item.finish_reason is None:
                    submission.keep_first_token(item)
            elif source == "decode":
                submission.finished = item.finish_reason is not None
                if first_token is not None and item.token_ids:
                    item, first_token = _without_first_token(item, first_token), None
            delta = self._consume(item, detokenizer)
            if rows is not None:
                delta.prompt_logprobs, rows = rows, None
            if delta.token_ids and delta.finish_reason is None:  # a choice over at once aborts both engines
                submission.release_prefill()
            if delta.finish_reason is not None:  # the prefix index learns the output after the answer is written
                if submission.decode_sent:
                    asyncio.get_running_loop().call_soon(self.gateway.policy.record_output, submission.route.decode,
                                                         self.spec.prompt_token_ids + self.token_ids,
                                                         submission.route.prompt_hashes)
                yield delta
                return
            if delta.token_ids or delta.text:
                yield delta

    def _take_notice(self, submission: Submission, source: str, item: Any,
                     gather: _PromptLogprobsGather | None) -> None:
        """What a link puts in the inbox besides tokens: an engine that left (retry elsewhere), or a chunk of
        the prompt's logprobs (gathered while the choice waits for them; dropped after its first token)."""
        if isinstance(item, EngineGone):
            raise _Retry(f"{source} engine {item.engine_id} left ({item.reason})",
                         exclude=getattr(submission.route, source).control_address,
                         force_local=source == "prefill")
        if gather is not None and isinstance(item, PromptLogprobsChunk):
            gather.add(source, item)

    async def _prompt_rows(self, submission: Submission, gather: _PromptLogprobsGather | None,
                           source: str) -> PromptRows:
        """The choice's prompt logprobs at its first token: those its engines sent (then shared with the
        prompt's other samples), or, for a sample that did not ask the engines, sample 0's."""
        shared = self.spec.shared_prompt_logprobs
        if gather is None:
            return await shared.wait()
        if not gather.complete and source == "decode" and submission.route.prefill is not None:
            await _prefill_engines_set(submission, gather)
        rows = gather.result(source)
        if shared is not None:
            shared.set(rows)
        return rows

    def _failed(self, source: str, delta: TokenDelta) -> None:
        """An engine ended the request with an error or abort: retry, or raise what the client sees."""
        message = delta.error or f"the {source} engine ended the request ({delta.finish_reason})"
        if delta.error_code == "engine_step_failed":  # final: another engine would fail the same way
            raise EngineFailed(f"the {source} engine failed while running the request: {message}")
        if source == "prefill":
            raise _Retry(f"prefill failed: {message}", force_local=True)
        if delta.error_code == "invalid_request":  # the request's own fault, after tokens too (a constraint that
            raise InvalidRequest(message)  # fails mid-way): a 400, or in a stream an error event after them
        raise EngineFailed(f"the decode engine failed the request: {message}")

    def _consume(self, delta: TokenDelta, detokenizer: Any) -> ChoiceDelta:
        """The delta's tokens up to a stop string's match, as text. A delta that finished with "stop" ends
        with the engine's stop token (EOS or a stop_token_ids one): the detokenizer leaves its text out (unless
        include_stop_str_in_output), as vLLM does; unless the request's structured output was complete, whose
        last token is text like any other."""
        if self.spec.prompt_only:  # echo without generation: the token the engines had to make is not shown
            return ChoiceDelta(self.spec.index, "", [], [], "length", None, delta.num_cached_tokens)
        new_ids: list[int] = []
        last = len(delta.token_ids) - 1
        ends_with_stop_token = delta.ends_with_stop_token
        for position, token_id in enumerate(delta.token_ids):
            new_ids.append(token_id)
            detokenizer.add_tokens([token_id], ends_with_stop_token=position == last and ends_with_stop_token)
            if detokenizer.stopped_by is not None:
                break
        self.token_ids.extend(new_ids)
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        if detokenizer.stopped_by is not None:
            finish_reason, stop_reason = "stop", detokenizer.stopped_by
        text = detokenizer.take_new_text(finished=finish_reason is not None)
        return ChoiceDelta(self.spec.index, text, new_ids, list(delta.logprobs[:len(new_ids)]),
                           finish_reason, stop_reason, delta.num_cached_tokens)


class _PromptLogprobsGather:
    """One attempt's prompt logprobs, gathered per engine that may send them (the prefill engine, or the
    decode engine when it prefills the prompt itself); the first whole set is the choice's."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.by_source = {source: PromptLogprobsAssembler(len(prompt_token_ids)) for source in ("prefill", "decode")}

    @property
    def complete(self) -> bool:
        return any(assembler.result is not None for assembler in self.by_source.values())

    def add(self, source: str, chunk: PromptLogprobsChunk) -> None:
        try:
            self.by_source[source].add(chunk.msg, chunk.rows)
        except ProtocolError as exc:
            raise EngineFailed(f"the {source} engine sent prompt logprobs that do not fit the prompt: {exc}",
                               code="internal_error") from exc

    def result(self, source: str) -> PromptRows:
        """The whole set, at the first token; its absence is the engine's fault, never silently skipped."""
        for assembler in self.by_source.values():
            if assembler.result is not None:
                return self._checked(source, assembler.result)
        raise EngineFailed(f"the {source} engine sent the first token before the prompt logprobs the request "
                           "asked for: the engine is at fault; retry, or report it with the engine's logs",
                           code="internal_error")

    def _checked(self, source: str, rows: PromptRows) -> PromptRows:
        """Each position's first entry is the prompt token's (control/prompt_logprobs.py): the responses read it."""
        for position in range(1, len(rows)):
            sent, expected = next(iter(rows[position])), self.prompt_token_ids[position]
            if sent != expected:
                raise EngineFailed(f"the {source} engine sent prompt logprobs for token {sent} at prompt position "
                                   f"{position}, which holds {expected}: the engine is at fault; report it with the "
                                   "engine's logs", code="internal_error")
        return rows


async def _prefill_engines_set(submission: Submission, gather: _PromptLogprobsGather) -> None:
    """The decode engine's first token came before the prefill engine's prompt logprobs (sent before the KV
    that token needed, but on another socket: nothing orders the two). Read the prefill engine's messages
    until its set is whole, or its first token (or error) came without it; the decode engine's wait, in order."""
    held: list[tuple[str, Any]] = []
    try:
        while not gather.complete:
            source, item = await _next(submission.inbox)
            if source != "prefill":
                held.append((source, item))
            elif isinstance(item, PromptLogprobsChunk):
                gather.add(source, item)
            elif isinstance(item, EngineGone):  # its set will not come: prefill on the decode engine instead
                raise _Retry(f"prefill engine {item.engine_id} left ({item.reason}) before the prompt logprobs came",
                             exclude=submission.route.prefill.control_address, force_local=True)
            else:
                return  # a token or an error, and no set before it: the engine's fault (gather.result says so)
    finally:
        submission.inbox.put_back(held)


async def _next(inbox: _Inbox) -> tuple[str, Any]:
    """The next (source, item) of an attempt's inbox; RequestTimeout once its deadline timer fired."""
    source, item = await inbox.get()
    if source is _DEADLINE:
        raise RequestTimeout("the request took longer than the router's request timeout: raise "
                             "--request-timeout or lower max_tokens")
    return source, item


def _one_seed_for_both(params: SamplingParams) -> SamplingParams:
    """An unseeded random choice sent to two engines gets a random seed, so that a decode engine that
    samples the first token itself (it prefills locally, before the prefill engine's FirstToken has come)
    draws the same token as the prefill engine (stateless seeds: docs/serving/sampling.md)."""
    if params.seed is not None or params.temperature == 0:
        return params
    return params.replace(seed=random.getrandbits(63))


def _without_first_token(delta: TokenDelta, first_token: int) -> TokenDelta:
    """The decode engine's first delta, less the first token the prefill engine already streamed."""
    if delta.token_ids[0] != first_token:
        raise EngineFailed(f"the decode engine continued from token {delta.token_ids[0]}, not from the first token "
                           f"{first_token} the prefill engine sampled and the client already has; retry the request")
    return TokenDelta(**{**vars(delta), "token_ids": delta.token_ids[1:], "logprobs": delta.logprobs[1:]})


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
