"""The route class of the two generation endpoints: FastAPI's route, with the body read and validated
here rather than by FastAPI's per-request dependency machinery (the reason: docs/design/request-lifecycle.md).

The body is refused as FastAPI refuses it (RequestValidationError, HTTPException 400), so the app's
exception handlers answer exactly as for any other route; a body that does not arrive whole within
BODY_TIMEOUT_S is a 408.

    app.add_api_route(path, endpoint, methods=["POST"], route_class_override=BodyRoute)
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Awaitable, Callable
from typing import Any, get_type_hints

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from pdserve.router.body_limit import content_length
from pdserve.router.errors import BodyTimeout


def is_json(content_type: str | None) -> bool:
    """FastAPI's test: application/json or application/*+json (parameters such as charset ignored)."""
    if not content_type:
        return False
    media_type = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _content_type(scope: Scope) -> str | None:
    """The Content-Type header, as Starlette's request.headers.get("content-type") reads it (the first one)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.decode("latin-1")
    return None


BODY_TIMEOUT_S = 30.0  # a body not whole by then (a trickle, or one never finished) is answered 408


async def read_body(receive: Receive, timeout_s: float | None = None) -> bytes:
    """The whole body, read as Starlette's Request.body() reads it (ClientDisconnect if the client leaves
    first), without its stream generator and the per-request Headers object around it; BodyTimeout if it
    has not all arrived within `timeout_s`."""
    timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s
    chunks = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        return b"".join(chunks)
                elif message["type"] == "http.disconnect":
                    raise ClientDisconnect()
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive whole within {timeout_s:g}s: send it at once") from None


LARGE_BODY_BYTES = 256 << 10  # bodies from this size are parsed with the cyclic collector paused


def loads(body: bytes) -> Any:
    """json.loads; for a large body with the collector paused, since the hundreds of thousands of lists a
    batch of prompts can hold would otherwise set off collection after collection while they are built."""
    if len(body) < LARGE_BODY_BYTES or not gc.isenabled():
        return json.loads(body)
    gc.disable()
    try:
        return json.loads(body)
    finally:
        gc.enable()


async def parse_body(request: Request, model: type[BaseModel],
                     check_raw: Callable[[Any], None] | None = None) -> Any:
    """The request body as `model`, refused as FastAPI refuses it: bad JSON and invalid fields as a
    RequestValidationError (locations under "body"), an unreadable body as HTTPException(400).
    `check_raw(parsed JSON)` runs before validation: it refuses what is too big to validate at all."""
    body: Any = await read_body(request.receive)
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        if body and is_json(_content_type(request.scope)):
            body = loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except Exception as exc:  # noqa: BLE001 - not UTF-8, nested too deep, an integer too long: FastAPI's 400
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
    if check_raw is not None:
        check_raw(body)
    try:
        return model.model_validate(body, from_attributes=True)  # as FastAPI validates
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=body) from None


class BodyRoute(APIRoute):
    """A FastAPI route for `endpoint(body: Model, request: Request) -> Response`, declared (and listed in
    /openapi.json) as any FastAPI route, but served without FastAPI's per-request dependency solving: the
    route's dependencies (each called as `dependency(request)`, e.g. the API key check) run first, then
    the body is read and validated by `parse_body`, with FastAPI's rules and errors."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        endpoint = self.endpoint
        model = get_type_hints(endpoint)["body"]
        checks = [depends.dependency for depends in self.dependencies]
        check_raw = getattr(endpoint, "check_raw_body", None)  # set by the app: e.g. the choice count

        async def handler(request: Request) -> Response:
            for check in checks:
                await check(request)
            budget = getattr(request.app.state, "body_budget", None)
            if budget is None:
                return await endpoint(await parse_body(request, model, check_raw), request)
            declared = content_length(request.scope)
            async with budget.holding(budget.undeclared_bytes if declared is None else declared):
                return await endpoint(await parse_body(request, model, check_raw), request)

        return handler
