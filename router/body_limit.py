"""An ASGI middleware that caps HTTP request bodies: a Content-Length over the cap is answered 413
before any of the body is read, and a body sent without one (chunked) is cut off with a 413 as soon
as what arrived passes the cap."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.errors import RequestTooLarge


def too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes: send a shorter prompt "
            f"(operators: --max-request-bytes)")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = refuse_declared(scope, self.max_bytes)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, counting_receive(receive, self.max_bytes), send)


def refuse_declared(scope: Scope, max_bytes: int) -> JSONResponse | None:
    """The 413 for a request whose Content-Length is over the cap (None when it is not)."""
    declared = content_length(scope)
    if declared is None or declared <= max_bytes:
        return None
    error = RequestTooLarge(too_large_message(max_bytes))
    return JSONResponse(error.body(), status_code=error.status_code)


def counting_receive(receive: Receive, max_bytes: int) -> Receive:
    """`receive`, raising HTTPException(413) once the body that arrived passes the cap."""
    num_bytes = 0

    async def counted() -> dict[str, Any]:
        nonlocal num_bytes
        message = await receive()
        num_bytes += len(message.get("body", b""))
        if num_bytes > max_bytes:  # FastAPI passes an HTTPException raised here to the handlers
            raise HTTPException(413, too_large_message(max_bytes))
        return message

    return counted


def content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
