"""The router's ASGI app: FastAPI, with the two generation endpoints served ahead of its middleware.

A POST to /v1/completions or /v1/chat/completions skips FastAPI's telemetry check, Starlette's middleware
stack (server errors, telemetry, body limits, exception handling, an exit stack) and its router, and goes
straight to the endpoint (router/lean_routes.py). On this shared 2-core machine those layers cost ~0.3 ms between the
request's bytes and the endpoint: code run once per request is slow here because every request finds
the caches cold (docs/results.md, router overhead). What the layers did for these routes is done here:
the body cap (router/body_limit.py), and errors answered by the app's own exception handlers, looked
up as Starlette looks them up. Every other request goes through the whole stack.

    RouterApp(...)                 a FastAPI app; RouterApp.fast_routes[path] = endpoint(request) -> Response
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.body_limit import BodyLimit, counting_receive, refuse_declared

Endpoint = Callable[[Request], Awaitable[Response]]


class FastPath:
    """ASGI: POSTs to `routes` served directly; everything else to `app` (the full middleware stack)."""

    def __init__(self, app: ASGIApp, routes: dict[str, Endpoint], handlers: dict[Any, Callable],
                 max_body_bytes: int) -> None:
        self.app = app
        self.routes = routes
        self.handlers = handlers  # exception class -> async handler(request, exc), as app.exception_handlers
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        response = refuse_declared(scope, self.max_body_bytes)
        if response is None:
            request = Request(scope, counting_receive(receive, self.max_body_bytes), send)
            response = await self._answer(endpoint, request)
        await response(scope, receive, send)

    async def _answer(self, endpoint: Endpoint, request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:  # noqa: BLE001 - every error gets the answer the app's handlers give it
            handler = self._handler_for(exc)
            if handler is None:
                raise
            return await handler(request, exc)

    def _handler_for(self, exc: Exception) -> Callable | None:
        """The handler of the closest class in the exception's MRO (Starlette's rule); `Exception`'s
        handler (a 500) last, as the server-error layer would answer."""
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        return None


class RouterApp(FastAPI):
    """FastAPI, with `fast_routes` (path -> endpoint) served by FastPath in front of the middleware stack;
    both paths cap request bodies at max_body_bytes (BodyLimit on the stack's)."""

    def __init__(self, *args: Any, max_body_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast_routes: dict[str, Endpoint] = {}
        self.max_body_bytes = max_body_bytes
        self.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A fast route goes to the stack's front (FastPath) directly: FastAPI's own __call__ asks OpenTelemetry for
        its tracer, meter and logger providers on every request (native telemetry), which pdserve, whose metrics
        are Prometheus', never configures. Everything else goes through FastAPI's __call__."""
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.fast_routes:
            if self.root_path:
                scope["root_path"] = self.root_path
            scope["app"] = self
            if self.middleware_stack is None:
                self.middleware_stack = self.build_middleware_stack()
            await self.middleware_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        if not self.fast_routes:
            return stack
        return FastPath(stack, self.fast_routes, self.exception_handlers, self.max_body_bytes)
