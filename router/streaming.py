"""Serving one API request once it is validated: run its choices, then answer with the whole
response or stream it as server-sent events. Also: admission (429), the client leaving (its work is
aborted on every engine: generation.Submission.close), and the request metrics.

A streamed response waits for the first event before sending its status line, so an error the
engines report before any token (a 400, a 503) is still a proper HTTP error; after that, errors
travel in the stream as `data: {"error": ...}` followed by `data: [DONE]`, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pdserve.router.errors import APIError
from pdserve.router.gateway import Gateway
from pdserve.router.generation import ChoiceDelta, ChoiceRunner, Restarted, merge
from pdserve.router.responses import (
    SSE_DONE,
    ChatFormatter,
    ChoiceTotal,
    Formatter,
    sse,
    whole_answer,
)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class ClientGone(Exception):
    """The HTTP client disconnected while its request was being served."""


def endpoint_label(request: Request) -> str:
    """The metrics label of a request's path: unknown paths share one label (no label per probe)."""
    path = request.scope["path"]  # not request.url, which parses the whole URL
    return path if path in ENDPOINTS else "other"


class _Timing:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}  # choice index -> when its latest tokens arrived
        self.itls: list[float] = []  # seconds between a choice's successive token deliveries

    def saw(self, delta: ChoiceDelta) -> None:
        if not delta.token_ids:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        previous = self.last_token.get(delta.index)
        if previous is not None:
            self.itls.append(now - previous)
        self.last_token[delta.index] = now

    def record(self, gateway: Gateway, formatter: Formatter) -> None:
        usage = formatter.usage()
        gateway.metrics.observe_request(
            ttft=None if self.first_token is None else self.first_token - self.start,
            e2e=time.monotonic() - self.start, num_prompt_tokens=usage["prompt_tokens"],
            num_generated_tokens=usage["completion_tokens"], itls=self.itls)
        for total in formatter.totals:
            if total.finish_reason is not None:
                gateway.metrics.count_finished(total.finish_reason)


class _DisconnectWatch:
    """Cancels the request's task (ClientGone, through `caught`) when its HTTP client disconnects. One
    watcher serves the whole request: the wait for the first token and then the stream, which therefore
    needs no task group of its own. Once `stop` runs (the last chunk is about to go) it cancels nothing."""

    def __init__(self, request: Request) -> None:
        self.task = asyncio.current_task()
        self.gone = False
        self.stopped = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(request.receive))

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.stopped:
            self.gone = True
            self.task.cancel()

    def caught(self) -> bool:
        """Inside `except CancelledError`: True, with the cancellation withdrawn, when the client left."""
        if self.gone:
            self.task.uncancel()
        return self.gone

    def stop(self) -> None:
        self.stopped = True
        self._watcher.cancel()


async def _until_disconnect(request: Request, awaitable: Awaitable) -> Any:
    """Await `awaitable`, cancelling it (ClientGone) if the client disconnects first."""
    watch = _DisconnectWatch(request)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if watch.caught():
            raise ClientGone() from None
        raise
    finally:
        watch.stop()


FormatterOf = Callable[[str], Formatter]  # the response id -> the request's formatter


async def respond(gateway: Gateway, request: Request, specs: list, formatter_of: FormatterOf,
                  stream: bool) -> Response:
    """Admit the request, send its choices to the engines, then build what answers it (the formatter and
    the response object, while the engines work) and answer, whole or streamed."""
    gateway.admit()
    handed_over = False
    runners: list[ChoiceRunner] = []
    try:
        response_id = uuid.uuid4().hex
        deadline = asyncio.get_running_loop().time() + gateway.config.request_timeout_s
        for spec in specs:
            runners.append(ChoiceRunner(gateway, spec, response_id, deadline=deadline, restartable=not stream))
            runners[-1].start()
        formatter = formatter_of(response_id)
        events = merge([runner.events() for runner in runners])
        timing = _Timing()
        if not stream:
            return await _respond_whole(gateway, request, events, formatter, timing)
        watch = _DisconnectWatch(request)  # handed over with the stream, or stopped here
        outcome = _StreamOutcome(gateway, endpoint_label(request), events, formatter, timing, runners)
        response = _EventStream(outcome, watch)
        try:
            first = await anext(events)
        except BaseException as exc:
            watch.stop()
            gone = isinstance(exc, asyncio.CancelledError) and watch.caught()
            await events.aclose()
            if gone:
                raise ClientGone() from None
            raise
        handed_over = True
        response.body_iterator = _stream(first, events, formatter, timing, outcome)
        return response
    except ClientGone:
        gateway.metrics.count_request(endpoint_label(request), str(CLIENT_CLOSED_REQUEST))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        if not handed_over:
            _abandon(runners)
            gateway.release()


def _abandon(runners: list[ChoiceRunner]) -> None:
    """Abort the attempts sent but never relayed: an error, or the client leaving, before events() ran."""
    for runner in runners:
        runner.abandon()


async def _respond_whole(gateway: Gateway, request: Request, events: AsyncIterator, formatter: Formatter,
                         timing: _Timing) -> Response:
    async def gather() -> None:
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Restarted):
                    formatter.totals[event.index] = ChoiceTotal()
                    timing.last_token.pop(event.index, None)  # the retry's first token starts afresh
                    continue
                timing.saw(event)
                formatter.totals[event.index].add(event)

    await _until_disconnect(request, gather())
    timing.record(gateway, formatter)
    gateway.metrics.count_request(endpoint_label(request), "200")
    return await whole_answer(formatter)


class _StreamOutcome:
    """What must happen once a stream ends, however it ends (even if it never started streaming):
    the engines' work aborted, the admission released, the metrics recorded."""

    def __init__(self, gateway: Gateway, endpoint: str, events: AsyncIterator, formatter: Formatter,
                 timing: _Timing, runners: list[ChoiceRunner]) -> None:
        self.gateway, self.endpoint, self.events, self.formatter, self.timing = \
            gateway, endpoint, events, formatter, timing
        self.runners = runners
        self.status = str(CLIENT_CLOSED_REQUEST)  # until the stream says otherwise

    async def close(self) -> None:
        try:
            await self.events.aclose()
        finally:
            _abandon(self.runners)
            self.gateway.release()
            self.timing.record(self.gateway, self.formatter)
            self.gateway.metrics.count_request(self.endpoint, self.status)


# the headers Starlette's init_headers({"Cache-Control": "no-cache"}) gives a text/event-stream response,
# written once rather than computed for every response
_EVENT_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream; charset=utf-8"))


class _EventStream(StreamingResponse):
    """Server-sent events, written from the request's own task: the status line and the first event go
    out back to back, with no task group per response (Starlette's costs ~0.25 ms before the first
    byte); the request's disconnect watcher, started before the first token, ends the stream if the
    client leaves."""

    body_iterator: AsyncIterator[str]  # set once the first event is in

    def __init__(self, outcome: _StreamOutcome, watch: _DisconnectWatch) -> None:  # StreamingResponse's, less content
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.raw_headers = list(_EVENT_STREAM_HEADERS)  # its own list: Starlette's `headers` can change it
        self.outcome = outcome
        self.watch = watch

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for text in self.body_iterator:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            self.watch.stop()  # from here on, a disconnect is the response being complete
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.watch.caught():
                raise
        finally:
            self.watch.stop()
            await self.outcome.close()


def _sse_of(delta: ChoiceDelta, formatter: Formatter, timing: _Timing) -> list[str]:
    timing.saw(delta)
    return [sse(chunk) for chunk in formatter.chunks(delta)]


async def _stream(first: ChoiceDelta, events: AsyncIterator, formatter: Formatter, timing: _Timing,
                  outcome: _StreamOutcome) -> AsyncIterator[str]:
    async with aclosing(events):
        try:
            if isinstance(formatter, ChatFormatter):
                for chunk in formatter.role_chunks():
                    yield sse(chunk)
            for text in _sse_of(first, formatter, timing):
                yield text
            async for event in events:
                for text in _sse_of(event, formatter, timing):
                    yield text
        except APIError as exc:  # the status line is sent: report the error in the stream, as vLLM does
            outcome.status = str(exc.status_code)
            yield sse(exc.body())
            yield SSE_DONE
            return
    if formatter.include_usage:
        yield sse(formatter.usage_chunk())
    yield SSE_DONE
    outcome.status = "200"
