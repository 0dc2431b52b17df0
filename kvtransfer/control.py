"""Control messages between the router (or a test driver) and the engines, on the same wire format
as the KV link (kvtransfer.protocol): typed msgpack headers, validated on receipt.

    router -> decode engine   GenerateRequest   (prefill_kv_address names the prefill engine's KV link,
                                                 or None to prefill locally)
    router -> prefill engine  PrefillRequest
    router -> either          Abort, StatsRequest
    decode engine -> router   TokenDelta        (new tokens, and the finish reason at the end)
    prefill engine -> router  TokenDelta        (only to report an error for the request)
    either -> router          EngineStats       (answer to StatsRequest, and the heartbeat)
    router -> either          DescribeRequest   (answered with Register: how a statically given
                                                 engine tells the router its KV address and limits)
    either -> router          Register          (on the router's registration socket, with EngineStats
                                                 every heartbeat; Deregister when it stops)

Stop strings, n and detokenization stay in the router; engines see token ids only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtransfer.protocol import MAX_ID_LEN, MAX_TOKENS, ROLES, Message, bounded

MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(frozen=True, kw_only=True)
class SamplingFields:
    """The engine-side sampling knobs of a request (engine.request.SamplingParams without the
    router-side ones: n, stop strings, skip_special_tokens). Defaults equal SamplingParams'."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = bounded(default=0, min=-1, max=MAX_TOKEN_ID)
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = bounded(default=None, min=1, max=MAX_TOKENS)
    min_tokens: int = bounded(default=0, min=0, max=MAX_TOKENS)
    stop_token_ids: tuple[int, ...] = bounded(default=(), max_len=MAX_STOP_TOKEN_IDS, min=0, max=MAX_TOKEN_ID)
    ignore_eos: bool = False
    logprobs: int | None = bounded(default=None, min=0, max=20)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.request.SamplingParams."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingFields)}

    @staticmethod
    def from_sampling_params(params: Any) -> dict[str, Any]:
        """The SamplingFields keyword arguments of an engine.request.SamplingParams."""
        return {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingFields)}


@dataclass(frozen=True, kw_only=True)
class GenerateRequest(SamplingFields, Message, type_name="generate"):
    request_id: str = bounded(max_len=MAX_ID_LEN)
    prompt_token_ids: tuple[int, ...] = bounded(max_len=MAX_TOKENS, min=0, max=MAX_TOKEN_ID)
    prefill_kv_address: str | None = bounded(default=None, max_len=1024)


@dataclass(frozen=True, kw_only=True)
class PrefillRequest(SamplingFields, Message, type_name="prefill"):
    request_id: str = bounded(max_len=MAX_ID_LEN)
    prompt_token_ids: tuple[int, ...] = bounded(max_len=MAX_TOKENS, min=0, max=MAX_TOKEN_ID)


@dataclass(frozen=True, kw_only=True)
class TokenDelta(Message, type_name="token_delta"):
    """New tokens of a request; finish_reason ("stop", "length", "abort", "error") marks the last one."""

    request_id: str = bounded(max_len=MAX_ID_LEN)
    token_ids: tuple[int, ...] = bounded(default=(), max_len=MAX_TOKENS, min=0, max=MAX_TOKEN_ID)
    logprobs: tuple[dict[int, float], ...] = bounded(default=(), max_len=MAX_TOKENS)
    finish_reason: str | None = bounded(default=None, choices=("stop", "length", "abort", "error"))
    stop_reason: int | None = None
    error: str | None = None
    num_prompt_tokens: int = bounded(default=0, min=0, max=MAX_TOKENS)
    num_cached_tokens: int = bounded(default=0, min=0, max=MAX_TOKENS)


@dataclass(frozen=True, kw_only=True)
class StatsRequest(Message, type_name="stats_request"):
    pass


@dataclass(frozen=True, kw_only=True)
class EngineStats(Message, type_name="engine_stats"):
    engine_id: str = bounded(max_len=MAX_ID_LEN)
    role: str = bounded(choices=ROLES)
    num_waiting: int = bounded(min=0)
    num_running: int = bounded(min=0)
    num_waiting_for_remote_kv: int = bounded(default=0, min=0)
    kv_blocks_used: int = bounded(min=0)
    kv_blocks_total: int = bounded(min=0)
    queued_prefill_tokens: int = bounded(min=0)
    num_preemptions: int = bounded(default=0, min=0)
    kv_bytes_sent: int = bounded(default=0, min=0)
    kv_bytes_received: int = bounded(default=0, min=0)
    num_kv_transfers_failed: int = bounded(default=0, min=0)
    num_kv_transfers: int = bounded(default=0, min=0)  # completed remote-prefill transfers (decode role)
    kv_transfer_seconds: float = 0.0  # their summed latency, KVWant sent -> KVDone verified


@dataclass(frozen=True, kw_only=True)
class DescribeRequest(Message, type_name="describe_request"):
    """Router -> engine on the control socket: answer with Register (static engine addresses)."""


@dataclass(frozen=True, kw_only=True)
class Register(Message, type_name="register"):
    """Engine -> router: who I am and where to reach me. Sent on the router's registration socket
    at start and with every heartbeat (so a restarted router relearns its engines), and as the
    answer to DescribeRequest. Addresses are the advertised ones (never 0.0.0.0)."""

    engine_id: str = bounded(max_len=MAX_ID_LEN)
    role: str = bounded(choices=ROLES)
    control_address: str = bounded(max_len=1024)
    kv_address: str | None = bounded(default=None, max_len=1024)
    block_size: int = bounded(min=1, max=MAX_TOKENS)
    max_model_len: int = bounded(min=1, max=MAX_TOKENS)
    vocab_size: int = bounded(min=1, max=MAX_TOKEN_ID)
    heartbeat_interval_s: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Deregister(Message, type_name="deregister"):
    """Engine -> router: I am stopping; take me out of routing now rather than after missed heartbeats."""

    engine_id: str = bounded(max_len=MAX_ID_LEN)
    control_address: str = bounded(max_len=1024)
