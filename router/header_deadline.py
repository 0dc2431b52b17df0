"""uvicorn's httptools protocol with a deadline on every request's headers.

uvicorn bounds the idle time between requests on a kept-alive connection (--timeout-keep-alive), but
not a new connection that sends nothing, nor headers that trickle in: about 20,000 such sockets used
up the router's file descriptors, and it answered no one until they closed (docs/results.md, "The
HTTP API under hostile clients"). Here the headers of each request must be whole
within HEADER_TIMEOUT_S of the connection opening (or of the request's first byte on a kept-alive
connection); else the client gets a 408 and the connection is closed. Bodies have their own limit
(router/lean_routes.py).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
LATE_HEADERS = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderDeadlineProtocol(HttpToolsProtocol):
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a later request on a kept-alive connection: its headers get the same time

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # never inside another request's response
            self.transport.write(LATE_HEADERS)
        self.transport.close()
