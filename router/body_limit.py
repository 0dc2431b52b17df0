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
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            error = RequestTooLarge(too_large_message(self.max_bytes))
            await JSONResponse(error.body(), status_code=error.status_code)(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        num_bytes = 0

        async def counted() -> dict[str, Any]:
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:  # FastAPI passes an HTTPException raised here to the handlers
                raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        return counted


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
