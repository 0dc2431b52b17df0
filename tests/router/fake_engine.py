"""A scripted engine on real ZeroMQ sockets, for router tests that need an engine to misbehave on
cue (stop heartbeating, go silent, fail a prefill, send a first token) without loading a model.

It speaks the real control protocol: Register/EngineStats heartbeats to the router's registration
socket, DescribeRequest/StatsRequest/Abort/GenerateRequest/PrefillRequest on its control socket.
A decode request streams `max_tokens` tokens, one TokenDelta per `token_delay_s`:
token i = (last prompt token + 1 + i) % vocab_size, the last delta with finish_reason "length"
(or the tokens of `script`, the last with finish_reason "stop": the stop token, as a real engine's EOS or
stop_token_ids token, whose text the router leaves out; or with `completes_constraint`, the token that
completed the request's structured output, whose text is shown: TokenDelta.stopped_by_constraint).
A request whose SamplingParams ask for prompt_logprobs gets them (fake_prompt_tables) before its first token from
the engine that prefills it: the prefill engine, or the decode engine when it prefills locally.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pdserve.control.errors import WireError
from pdserve.control.messages import (
    Abort,
    DescribeRequest,
    EngineStats,
    FirstToken,
    GenerateRequest,
    PrefillRequest,
    Register,
    StatsRequest,
    TokenDelta,
)
from pdserve.control.prompt_logprobs import pack
from pdserve.control.sockets import ClientSocket, ServerSocket

VOCAB_SIZE = 1024


def fake_tokens(prompt_token_ids, count: int) -> list[int]:
    return [(prompt_token_ids[-1] + 1 + i) % VOCAB_SIZE for i in range(count)]


def fake_prompt_logprob(position: int, column: int) -> float:
    """The fake logprob of column `column` (0: the prompt token) at prompt position `position`."""
    return -(position + max(column - 1, 0)) / 8


def fake_prompt_tables(prompt_token_ids, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PromptLogprobs tables (ids [P, k + 1], logprobs [P, k + 1], ranks [P]) for positions 1..n-1: the prompt
    token is the likeliest (rank 1), its top-k are it and the next k - 1 ids."""
    positions = range(1, len(prompt_token_ids))
    ids = [[prompt_token_ids[p]] + [(prompt_token_ids[p] + c) % VOCAB_SIZE for c in range(k)] for p in positions]
    logprobs = [[fake_prompt_logprob(p, c) for c in range(k + 1)] for p in positions]
    return (np.array(ids, dtype=np.int32).reshape(-1, k + 1), np.array(logprobs, dtype=np.float32).reshape(-1, k + 1),
            np.ones(len(positions), dtype=np.int32))


@dataclass
class _Active:
    peer_id: bytes
    tokens: list[int]
    next_at: float
    sent: int = 0


@dataclass
class FakeEngine:
    role: str = "decode"
    engine_id: str = "fake"
    router_address: str | None = None
    token_delay_s: float = 0.01
    max_model_len: int = 512
    fail_prefill: bool = False  # answer every PrefillRequest with an error
    prefill_error_code: str | None = None  # its TokenDelta.error_code
    first_token: bool = False  # answer every PrefillRequest with its first token (fake_tokens' first), at once
    first_token_delay_s: float = 0.0  # ... or after this long (the decode engine's first token may come first)
    reject_with: str | None = None  # answer every GenerateRequest with this error, before any token
    reject_code: str = "invalid_request"  # its TokenDelta.error_code
    script: list[int] | None = None  # emit these tokens (then "stop") instead of counting up
    # the script's last token (decode) or the first token (prefill) completes the request's structured output
    completes_constraint: bool = False
    send_prompt_logprobs: bool = True  # False: a faulty engine that skips the prompt logprobs a request asked for
    heartbeat_interval_s: float = 0.1
    beating: threading.Event = field(default_factory=threading.Event)  # set: send heartbeats
    answering: threading.Event = field(default_factory=threading.Event)  # set: handle control messages
    reported: dict = field(default_factory=dict)  # EngineStats fields to report instead of the live ones (lagging)
    received: list = field(default_factory=list)  # every request message, in order
    aborted: list[str] = field(default_factory=list)
    stats_requests: int = 0  # StatsRequests answered (the router's /metrics refreshes)

    def __post_init__(self) -> None:
        self.control = ServerSocket("tcp://127.0.0.1:0")
        self.kv_address = "tcp://127.0.0.1:9" if self.role == "prefill" else None
        self.active: dict[str, _Active] = {}
        self._stop = threading.Event()
        self._registration = ClientSocket(self.router_address) if self.router_address else None
        self.beating.set()
        self.answering.set()
        self._thread = threading.Thread(target=self._run, name=f"fake-{self.engine_id}", daemon=True)
        self._thread.start()

    @property
    def control_address(self) -> str:
        return self.control.address

    def register_msg(self) -> Register:
        return Register(engine_id=self.engine_id, role=self.role, control_address=self.control_address,
                        kv_address=self.kv_address, block_size=4, max_model_len=self.max_model_len,
                        vocab_size=VOCAB_SIZE, heartbeat_interval_s=self.heartbeat_interval_s)

    def stats_msg(self) -> EngineStats:
        live = {"num_waiting": 0, "num_running": len(self.active), "kv_blocks_used": len(self.active),
                "kv_blocks_total": 100, "queued_prefill_tokens": 0}
        return EngineStats(engine_id=self.engine_id, role=self.role, **{**live, **self.reported})

    def generate_requests(self) -> list[GenerateRequest]:
        return [msg for msg in self.received if isinstance(msg, GenerateRequest)]

    # ---- the loop ----

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self._registration is not None and self.beating.is_set() and now >= next_beat:
                next_beat = now + self.heartbeat_interval_s
                self._beat()
            if self.answering.is_set():
                self._handle_control()
                self._stream(now)
            else:
                time.sleep(0.002)

    def _beat(self) -> None:
        for msg in (self.register_msg(), self.stats_msg()):
            try:
                self._registration.send(msg, timeout=0.05)
            except WireError:
                pass

    def _handle_control(self) -> None:
        routed = self.control.recv(timeout=0.002)
        if routed is None:
            return
        msg, peer_id = routed.msg, routed.peer_id
        if isinstance(msg, StatsRequest):
            self.stats_requests += 1
            self._reply(peer_id, self.stats_msg())
        elif isinstance(msg, DescribeRequest):
            self._reply(peer_id, self.register_msg())
        elif isinstance(msg, Abort):
            self.aborted.append(msg.request_id)
            self.active.pop(msg.request_id, None)
        elif isinstance(msg, PrefillRequest):
            self.received.append(msg)
            if self.fail_prefill:
                self._reply(peer_id, TokenDelta(request_id=msg.request_id, finish_reason="error",
                                                error="fake prefill failure", error_code=self.prefill_error_code))
            elif self.first_token:
                time.sleep(self.first_token_delay_s)
                self._send_prompt_logprobs(peer_id, msg)
                done = {"finish_reason": "stop", "stopped_by_constraint": True} if self.completes_constraint else {}
                self._reply(peer_id, TokenDelta(request_id=msg.request_id,
                                                token_ids=tuple(fake_tokens(msg.prompt_token_ids, 1)), **done))
        elif isinstance(msg, FirstToken):
            self.received.append(msg)
        elif isinstance(msg, GenerateRequest):
            self.received.append(msg)
            if self.reject_with is not None:
                self._reply(peer_id, TokenDelta(request_id=msg.request_id, finish_reason="error",
                                                error=self.reject_with, error_code=self.reject_code))
                return
            if msg.prefill_kv_address is None:
                self._send_prompt_logprobs(peer_id, msg)
            tokens = self.script or fake_tokens(msg.prompt_token_ids, msg.sampling_params.max_tokens or 16)
            tokens = tokens[len(getattr(msg, "resume_token_ids", ())):]  # a migrated request goes on after its output
            self.active[msg.request_id] = _Active(peer_id, tokens, time.monotonic() + self.token_delay_s)

    def _stream(self, now: float) -> None:
        for request_id, active in list(self.active.items()):
            if now < active.next_at:
                continue
            token = active.tokens[active.sent]
            active.sent += 1
            active.next_at = now + self.token_delay_s
            last = active.sent == len(active.tokens)
            finish_reason = ("stop" if self.script else "length") if last else None
            self._reply(active.peer_id, TokenDelta(request_id=request_id, token_ids=(token,),
                                                   finish_reason=finish_reason,
                                                   stopped_by_constraint=finish_reason == "stop"
                                                   and self.completes_constraint))
            if last:
                del self.active[request_id]

    def _send_prompt_logprobs(self, peer_id: bytes, msg) -> None:
        k = msg.sampling_params.prompt_logprobs
        if k is None or not self.send_prompt_logprobs or len(msg.prompt_token_ids) < 2:
            return
        for part, buffers in pack(msg.request_id, *fake_prompt_tables(msg.prompt_token_ids, k)):
            self._reply(peer_id, part, *buffers)

    def _reply(self, peer_id: bytes, msg, *buffers) -> None:
        try:
            self.control.send(peer_id, msg, *buffers, timeout=0.5)
        except WireError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.control.close()
        if self._registration is not None:
            self._registration.close()
