"""The two generation endpoints without FastAPI's route machinery (router/fast_path.py serves them).

FastAPI's route machinery (dependency solving, an email-module parse of the content type, telemetry
hooks, an exit stack) took ~0.3 ms of the ~0.75 ms the router spent on a request before the engine had
it (docs/BENCHMARKS.md, issue #17). These routes read and validate the body themselves, with FastAPI's
rules and FastAPI's errors (RequestValidationError, HTTPException 400), so the app's exception handlers
answer exactly as before. FastAPI's routes stay registered for /openapi.json.

    lean_endpoint(model, handler, check_api_key) -> async endpoint(request) -> Response
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope

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


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The request body as `model`, refused as FastAPI refuses it: bad JSON and invalid fields as a
    RequestValidationError (locations under "body"), an unreadable body as HTTPException(400)."""
    body: Any = await read_body(request.receive)
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        if body and is_json(_content_type(request.scope)):
            body = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except Exception as exc:  # noqa: BLE001 - not UTF-8, nested too deep, an integer too long: FastAPI's 400
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
    try:
        return model.model_validate(body, from_attributes=True)  # as FastAPI validates
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=body) from None


def lean_endpoint(model: type[BaseModel], handler: Callable[[Any, Request], Awaitable[Response]],
                  check_api_key: Callable[[Request], Awaitable[None]] | None
                  ) -> Callable[[Request], Awaitable[Response]]:
    """`handler` as an endpoint taking the bare request: key checked, body parsed as `model`."""
    async def endpoint(request: Request) -> Response:
        if check_api_key is not None:
            await check_api_key(request)
        return await handler(await parse_body(request, model), request)

    return endpoint
