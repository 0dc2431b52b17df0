"""A bare relay: the fewest steps a Python HTTP front end on uvicorn + uvloop + pyzmq can take to serve a
completion from one pdserve engine. It is the floor that the router-overhead benchmark measures the
router against (`python experiments/router_overhead.py --router bare`), not something to serve with.

    python experiments/bare_relay.py --decode-address tcp://127.0.0.1:PORT

Per request it does what any relay must, and nothing more: read the HTTP body, json-parse it, send one
GenerateRequest (built and checked by pdserve's wire code), read the TokenDeltas (decoded and checked the
same way) from a reader callback on the socket's descriptor, and answer with JSON, or one server-sent
event per delta. No FastAPI, no request schema, tokenizer, admission, routing policy, metrics, retries
or stop strings: the router's difference to it is what those cost.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket

import uvicorn
import zmq

from pdserve.control.messages import GenerateRequest, TokenDelta
from pdserve.control.protocol import decode, encode
from pdserve.control.sampling_params import SamplingParams


class EngineReader:
    """One DEALER to the engine; deltas routed to per-request queues by a descriptor callback."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.connect(address)
        self.queues: dict[str, asyncio.Queue] = {}
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.socket.FD, self.read)

    def send(self, msg: GenerateRequest) -> None:
        self.socket.send_multipart(encode(msg), flags=zmq.NOBLOCK)
        self.loop.call_soon(self.read)  # the send may have taken the descriptor's wake-up

    def read(self) -> None:
        while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg, _ = decode(self.socket.recv_multipart(zmq.NOBLOCK, copy=False))
            if isinstance(msg, TokenDelta) and msg.request_id in self.queues:
                self.queues[msg.request_id].put_nowait(msg)


def make_app(address: str):
    ids = (f"bare-{i}" for i in itertools.count())
    state: dict[str, EngineReader] = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            state["engine"] = EngineReader(address)
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = json.loads(b"".join(chunks))
        engine, request_id, queue = state["engine"], next(ids), asyncio.Queue()
        engine.queues[request_id] = queue
        params = SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], ignore_eos=True)
        engine.send(GenerateRequest(request_id=request_id, prompt_token_ids=tuple(body["prompt"]),
                                    sampling_params=params))
        try:
            if body.get("stream"):
                await _stream(queue, send)
            else:
                await _whole(queue, send)
        finally:
            del engine.queues[request_id]

    return app


async def _whole(queue: asyncio.Queue, send) -> None:
    token_ids = []
    while True:
        delta = await queue.get()
        token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            break
    payload = json.dumps({"choices": [{"token_ids": token_ids, "finish_reason": delta.finish_reason}]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def _stream(queue: asyncio.Queue, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    while True:
        delta = await queue.get()
        event = {"choices": [{"token_ids": list(delta.token_ids), "finish_reason": delta.finish_reason}]}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                    "more_body": True})
        if delta.finish_reason is not None:
            break
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/bare_relay.py", description=__doc__.splitlines()[0])
    parser.add_argument("--decode-address", required=True, help="the engine's control address")
    parser.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (0: any free one)")
    args = parser.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY, as the router
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)
    print(f"PDSERVE_READY role=bare-relay url=http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(make_app(args.decode_address), log_level="warning", access_log=False,
                                           lifespan="on"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
