"""A synthetic OpenAI-compatible server with no model: it streams max_tokens one-token chunks as fast as
it can, so `pdserve bench` can measure its own ceiling and be tested against failures.

    python -m pdserve.bench.mock_server [--port 0] [--chunks-per-write 1] [--refuse FIELD ...]

Prints `FAKE_OPENAI_READY url=http://127.0.0.1:PORT` once listening. A prompt (or chat message) that
contains a marker misbehaves on purpose:
  [fault:500]   HTTP 500 with an OpenAI error body
  [fault:drop]  two chunks, then the connection is cut
  [fault:stall] two chunks, then nothing (until the client gives up)
--refuse FIELD answers 400 to requests that carry FIELD (ignore_eos, min_tokens, stream_options), and
--refuse token_ids to prompts given as token ids, like servers without those extensions.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import socket
import time

from aiohttp import web

FAULTS = ("500", "drop", "stall")
FAULT_CHUNKS = 2
CREATED = int(time.time())


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@functools.cache
def _chunk(chat: bool, last: bool) -> bytes:
    """One token's SSE event, rendered once (the server should cost far less per chunk than the client)."""
    finish = "length" if last else None
    choice = ({"index": 0, "delta": {"content": " tok"}, "finish_reason": finish} if chat
              else {"index": 0, "text": " tok", "finish_reason": finish})
    return _sse({"id": "fake", "object": "chunk", "created": CREATED, "model": "fake", "choices": [choice]})


def _prompt_of(body: dict) -> tuple[str, int]:
    """(text to look for fault markers in, prompt tokens as this server counts them)."""
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        return text, len(text.split())
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "", len(prompt)
    return str(prompt), len(str(prompt).split())


def _fault_of(text: str) -> str | None:
    return next((fault for fault in FAULTS if f"[fault:{fault}]" in text), None)


def _refusal(body: dict, refused: set[str]) -> str | None:
    if "token_ids" in refused and isinstance(body.get("prompt"), list):
        return "prompt must be a string"
    return next((f"unsupported field: {name}" for name in refused if name in body), None)


class FakeServer:
    def __init__(self, chunks_per_write: int = 1, refused: set[str] | None = None) -> None:
        self.chunks_per_write = chunks_per_write
        self.refused = refused or set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "root": None}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        refusal = _refusal(body, self.refused)
        if refusal:
            return web.json_response({"error": {"message": refusal, "type": "BadRequestError"}}, status=400)
        text, num_prompt = _prompt_of(body)
        fault = _fault_of(text)
        if fault == "500":
            return web.json_response({"error": {"message": "injected failure", "type": "InternalServerError"}},
                                     status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = request.path.endswith("/chat/completions")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        chunks = [_chunk(chat, last=False)] * (max_tokens - 1) + [_chunk(chat, last=True)]
        if fault is not None:
            await response.write(b"".join(chunks[:FAULT_CHUNKS]))
            if fault == "drop":
                request.transport.close()
                return response
            await asyncio.sleep(3600)  # stall: the client's read timeout ends it
        for start in range(0, len(chunks), self.chunks_per_write):
            await response.write(b"".join(chunks[start:start + self.chunks_per_write]))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": num_prompt, "completion_tokens": max_tokens,
                     "total_tokens": num_prompt + max_tokens}
            await response.write(_sse({"object": "chunk", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def serve(server: FakeServer, host: str, port: int) -> None:
    sock = socket.create_server((host, port))
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"FAKE_OPENAI_READY url=http://{host}:{sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunks-per-write", type=int, default=1,
                        help="SSE events per socket write (more: the server spends less per chunk)")
    parser.add_argument("--refuse", action="append", default=[],
                        choices=["ignore_eos", "min_tokens", "stream_options", "token_ids"])
    args = parser.parse_args()
    try:
        asyncio.run(serve(FakeServer(args.chunks_per_write, set(args.refuse)), args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
