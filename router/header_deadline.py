"""uvicorn's httptools protocol with a deadline on every request's headers.

uvicorn bounds the idle time between requests on a kept-alive connection (--timeout-keep-alive), but
not a new connection that sends nothing, nor headers that trickle in: about 20,000 such sockets used
up the router's file descriptors, and it answered no one until they closed (docs/results.md, "The
HTTP API under hostile clients"). Here the headers of each request must be whole
within HEADER_TIMEOUT_S of the connection opening (or of the request's first byte on a kept-alive
connection); else the client gets a 408 and the connection is closed. The headers (request line
included) may also take at most MAX_HEADER_BYTES: beyond it the client gets a 431 before any of the app
runs (the parser keeps every header it reads, so an unbounded one costs memory and event-loop time).
Bodies have their own limit (router/body_route.py, router/body_limit.py).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
LATE_HEADERS = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
MAX_HEADER_BYTES = 32 * 1024  # nginx's default allows 4 buffers of 8 KiB (large_client_header_buffers)
LINGER_S = 1.0  # after a 431, what the client still sends is read and dropped this long, so it can read the answer


def headers_too_large_answer(limit: int) -> bytes:
    """The 431 for headers over `limit` bytes, in OpenAI's error shape."""
    body = json.dumps({"error": {
        "message": (f"the request's headers are larger than this server's limit of {limit} bytes: send fewer "
                    "or shorter headers (cookies, tokens)"),
        "type": "invalid_request_error", "param": None, "code": "request_header_fields_too_large"}}).encode()
    head = (f"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class HeaderDeadlineProtocol(HttpToolsProtocol):
    _deadline: asyncio.TimerHandle | None = None
    _header_bytes: int | None = 0  # bytes received of the current request's headers; None once they are whole
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # after a 431: dropped until the linger ends
        if self._header_bytes is not None:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._header_bytes is not None and self._header_bytes > MAX_HEADER_BYTES:
            self._refuse_headers()

    def on_message_complete(self) -> None:
        self._header_bytes = 0  # what comes next on this connection is the next request's headers
        super().on_message_complete()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a later request on a kept-alive connection: its headers get the same time

    def on_headers_complete(self) -> None:
        self._disarm()
        self._header_bytes = None
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

    def _refuse_headers(self) -> None:
        self._disarm()
        self._refused = True
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # never inside another request's response
            self.transport.write(headers_too_large_answer(MAX_HEADER_BYTES))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
