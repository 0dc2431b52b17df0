"""Control messages between the router (or a test driver) and the engines, in the wire format of
pdserve.control.protocol; Abort and Error serve the KV link too.

    router -> decode engine   GenerateRequest   (prefill_kv_address names the prefill engine's KV link,
                                                 or None to prefill locally)
    router -> prefill engine  PrefillRequest
    router -> either          Abort, StatsRequest       (Abort and Error: either way, on either plane)
    decode engine -> router   TokenDelta        (new tokens, and the finish reason at the end)
    either -> router          PromptLogprobs    (+ 3 payload frames; before the request's first TokenDelta,
                                                 when its SamplingParams ask for prompt_logprobs)
    prefill engine -> router  TokenDelta        (the first token as soon as it is sampled, before its KV
                                                 is sent; finish_reason set only when that token ends the
                                                 request; or an error)
    router -> decode engine   FirstToken        (the prefill engine's first token, which the decode engine
                                                 keeps if it has to prefill the prompt itself)
    either -> router          EngineStats       (answer to StatsRequest, and the heartbeat)
    router -> either          DescribeRequest   (answered with Register: how a statically given
                                                 engine tells the router its KV address and limits)
    either -> router          Register          (on the router's registration socket, with EngineStats
                                                 every heartbeat; Deregister when it stops)
    router -> decode engine   KVPeers           (answer on the registration socket: the KV addresses of
                                                 the registered prefill engines, the only ones it pulls from)

Requests carry their SamplingParams (control.sampling_params) whole, as vLLM's EngineCoreRequest does,
but stop strings and detokenization are the router's: engines see token ids only. The engine's
scheduler makes each TokenDelta, and the engine loop sends it as it is.
"""

from __future__ import annotations

import secrets
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, FailFast, Field, field_validator, model_validator

from pdserve.control.sampling_params import SamplingParams
from pdserve.control.schema import (
    MAX_DICT_ITEMS,
    MAX_ID_LEN,
    MAX_LOGPROBS,
    MAX_STR_LEN,
    MAX_TOKENS,
    MAX_TOKEN_ID,
    Message,
    Role,
    TokenId,
    UINT64_MAX,
    WireInt,
    WireModel,
    max_items,
)

Count = Annotated[int, Field(ge=0, le=UINT64_MAX)]
# An engine process's random id, made at its start: a new one at the same address is a restarted engine,
# a new peer (docs/design/kv-link.md). Empty where a peer has none to give (test doubles).
Incarnation = Annotated[str, Field(max_length=32, pattern=r"^[0-9a-f]*$")]


def new_incarnation() -> str:
    """A fresh incarnation: 16 hex digits, one per engine process."""
    return secrets.token_hex(8)


def _clipped(text: object) -> object:
    """An error's text cut to MAX_STR_LEN characters: the reason a request failed may quote what failed (a
    grammar's error, a step's exception), and a long one must not make the message unsendable."""
    return text[:MAX_STR_LEN - 1] + "…" if isinstance(text, str) and len(text) > MAX_STR_LEN else text


ErrorText = Annotated[str, BeforeValidator(_clipped)]
# A list is stored as a tuple. FailFast: the first bad item is the error; a million bad ids in a header
# at the size cap would otherwise make a million errors (seconds of an engine's loop).
TokenIds = Annotated[tuple[TokenId, ...], FailFast(), max_items(MAX_TOKENS)]
TokenLogprobs = Annotated[dict[WireInt, float], max_items(MAX_DICT_ITEMS)]  # {token_id: logprob} of one token


class GenerateRequest(Message, type_name="generate"):
    request_id: str = Field(max_length=MAX_ID_LEN)
    prompt_token_ids: TokenIds
    sampling_params: SamplingParams
    prefill_kv_address: Annotated[str, Field(max_length=1024)] | None = None
    # a migrated request (router/migration.py): the output tokens it already generated on an engine that was
    # lost, which the client has. The engine prefills prompt + these itself (no prefill_kv_address) and goes
    # on from there as if it had sampled them: max_tokens, seeds, penalties and a constraint count them.
    resume_token_ids: TokenIds = ()


class PrefillRequest(Message, type_name="prefill"):
    request_id: str = Field(max_length=MAX_ID_LEN)
    prompt_token_ids: TokenIds
    sampling_params: SamplingParams


class TokenDelta(Message, type_name="token_delta"):
    """New tokens of a request; finish_reason ("stop", "length", "abort", "error") marks the last one."""

    request_id: str = Field(max_length=MAX_ID_LEN)
    token_ids: TokenIds = ()
    logprobs: Annotated[tuple[TokenLogprobs, ...], FailFast(), max_items(MAX_TOKENS)] = ()
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    stop_reason: WireInt | None = None
    error: ErrorText | None = None
    # with finish_reason "error": whose fault. invalid_request = the request itself (the router answers
    # 400); kv_transfer_failed / internal_error = the serving side (502); engine_step_failed = the engine
    # raised while running the request's step (502, never retried: the request may fail any engine)
    error_code: Literal["invalid_request", "kv_transfer_failed", "internal_error", "engine_step_failed"] | None = None
    num_prompt_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    num_cached_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    # finish_reason "stop" because the request's structured output is complete: its last token is text
    # (otherwise a "stop" ends with the engine's stop token, whose text the client is not shown)
    stopped_by_constraint: bool = False

    @property
    def ends_with_stop_token(self) -> bool:
        """The delta's last token is the engine's stop token (EOS or a stop_token_ids one), whose text the
        client is not shown: a "stop" that a complete constraint did not make."""
        return self.finish_reason == "stop" and not self.stopped_by_constraint


MAX_PROMPT_LOGPROB_ENTRIES = 1 << 16  # num_positions * width of one PromptLogprobs: 256 KiB frames


class PromptLogprobs(Message, type_name="prompt_logprobs", max_frames=3):
    """Engine -> router, before a request's first TokenDelta: the logprobs of prompt tokens
    [start, start + num_positions) (position 0 has none), from the engine that ran the prompt's forward.
    A long prompt takes several, in order; `last` marks the one that ends at the prompt's end.

    Payload frames (native little-endian, row-major; control/prompt_logprobs.py packs and reads them):
        token_ids  int32   [num_positions, width]  column 0 the prompt token, then the top width - 1 ids
        logprobs   float32 [num_positions, width]  their logprobs (of the raw logits)
        ranks      int32   [num_positions]         the prompt token's rank in the vocabulary (1 = likeliest)
    """

    request_id: str = Field(max_length=MAX_ID_LEN)
    start: int = Field(ge=1, le=MAX_TOKENS)
    num_positions: int = Field(ge=1, le=MAX_PROMPT_LOGPROB_ENTRIES)
    width: int = Field(ge=1, le=MAX_LOGPROBS)
    last: bool

    @model_validator(mode="after")
    def _bounded(self) -> PromptLogprobs:
        if self.num_positions * self.width > MAX_PROMPT_LOGPROB_ENTRIES:
            raise ValueError(f"{self.num_positions} positions of width {self.width} exceed "
                             f"{MAX_PROMPT_LOGPROB_ENTRIES} entries in one message")
        return self

    def frame_sizes(self) -> tuple[int, ...]:
        entries = self.num_positions * self.width
        return (entries * 4, entries * 4, self.num_positions * 4)


class FirstToken(Message, type_name="first_token"):
    """Router -> decode engine: the first token the prefill engine sampled for a request, already sent to
    the client. A decode engine that prefills the prompt itself (KV lost and recomputed, or the prefill
    engine not trusted) emits this token instead of sampling its own, so its stream continues the text
    the client has."""

    request_id: str = Field(max_length=MAX_ID_LEN)
    token_id: TokenId
    logprobs: TokenLogprobs | None = None


class StatsRequest(Message, type_name="stats_request"):
    pass


class KVSideStats(WireModel):
    """One role's side of a dual-role engine's KV transfers, since start (the fields as in EngineStats)."""

    type_name: ClassVar[str] = "kv_side_stats"
    kv_bytes_sent: Count = 0
    kv_bytes_received: Count = 0
    num_kv_transfers_failed: Count = 0
    num_kv_transfers: Count = 0
    kv_transfer_seconds: float = 0.0


Amount = Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)]


class StepTimes(WireModel):
    """An engine's recent steps as time-decayed sums: their measured seconds and what the step model prices in
    them (router/step_model.py scales its predictions by measured over predicted). Decode steps compute no
    prompt token; prompt steps compute some (with any decodes riding along)."""

    type_name: ClassVar[str] = "step_times"
    decode_seconds: Amount = 0.0
    decode_steps: Amount = 0.0
    decode_seqs: Amount = 0.0  # sequences decoded, summed over the steps
    decode_context_tokens: Amount = 0.0  # tokens they attended
    prompt_seconds: Amount = 0.0
    prompt_steps: Amount = 0.0
    prompt_tokens: Amount = 0.0
    prompt_squares: Amount = 0.0  # of each prompt chunk, (computed + new)^2 - computed^2: a prompt's L^2 in all
    prompt_decode_seqs: Amount = 0.0
    prompt_decode_context_tokens: Amount = 0.0


class EngineStats(Message, type_name="engine_stats"):
    engine_id: str = Field(max_length=MAX_ID_LEN)
    role: Role
    num_waiting: Count
    num_running: Count
    num_waiting_for_remote_kv: Count = 0
    kv_blocks_used: Count
    kv_blocks_total: Count
    queued_prefill_tokens: Count
    num_preemptions: Count = 0
    prefix_cache_queries: Count = 0  # prompt tokens looked up in the engine's prefix cache, since start
    prefix_cache_hits: Count = 0  # of those, tokens whose KV was reused instead of computed
    kv_bytes_sent: Count = 0
    kv_bytes_received: Count = 0
    num_kv_transfers_failed: Count = 0
    num_kv_transfers: Count = 0  # completed transfers: received and verified (decode), acked (prefill)
    # their summed time: decode role, KVWant sent -> KVDone verified (the whole transfer); prefill
    # role, prompt computed -> KVAck received (the part that layer-wise streaming did not hide)
    kv_transfer_seconds: float = 0.0
    # a dual-role engine's KV figures above, split by the role it took in each transfer (they add up to the
    # figures above); zero on fixed-role engines and on dual engines that predate the split
    kv_prefill_side: KVSideStats = KVSideStats()
    kv_decode_side: KVSideStats = KVSideStats()
    step_times: StepTimes = StepTimes()  # its recent steps' times (the adaptive router's calibration)


class DescribeRequest(Message, type_name="describe_request"):
    """Router -> engine on the control socket: answer with Register (static engine addresses)."""


class Register(Message, type_name="register"):
    """Engine -> router: who I am and where to reach me. Sent on the router's registration socket
    at start and with every heartbeat (so a restarted router relearns its engines), and as the
    answer to DescribeRequest. Addresses are the advertised ones (never 0.0.0.0)."""

    engine_id: str = Field(max_length=MAX_ID_LEN)
    role: Role
    control_address: str = Field(max_length=1024)
    kv_address: Annotated[str, Field(max_length=1024)] | None = None
    block_size: int = Field(ge=1, le=MAX_TOKENS)
    max_model_len: int = Field(ge=1, le=MAX_TOKENS)
    vocab_size: int = Field(ge=1, le=MAX_TOKEN_ID)
    heartbeat_interval_s: float = 1.0
    incarnation: Incarnation = ""  # a new one at the same control address replaces the entry (a restart)

    @field_validator("control_address", "kv_address")
    @classmethod
    def _connectable(cls, address: str | None) -> str | None:
        host = (address or "").partition("://")[2].rpartition(":")[0].strip("[]")
        if host in ("0.0.0.0", "*", "::"):
            raise ValueError(f"{address} is a bind-any address no peer can connect to: the engine must advertise "
                             f"its IP (--advertise-address)")
        return address


class Deregister(Message, type_name="deregister"):
    """Engine -> router: I am stopping; take me out of routing now rather than after missed heartbeats."""

    engine_id: str = Field(max_length=MAX_ID_LEN)
    control_address: str = Field(max_length=1024)


MAX_KV_PEERS = 1024


class KVPeers(Message, type_name="kv_peers"):
    """Router -> decode engine, on the registration link the decode engine opened: the KV addresses of
    every prefill engine registered now. A decode engine pulls KV only from these (and from its
    --kv-peer addresses), never from an address that a control message alone names."""

    kv_addresses: Annotated[tuple[Annotated[str, Field(max_length=1024)], ...], max_items(MAX_KV_PEERS)]
    # KV address -> the incarnation registered there: a change tells the decode engine that the prefill
    # engine restarted, and its link to the old one goes at once
    incarnations: Annotated[dict[Annotated[str, Field(max_length=1024)], Incarnation], max_items(MAX_KV_PEERS)] = {}


class Abort(Message, type_name="abort"):
    """Either way, on either plane: stop work on a request and free what it holds."""

    request_id: str = Field(max_length=MAX_ID_LEN)
    reason: str = ""


class Error(Message, type_name="error"):
    """Either way, on either plane: the peer's last message could not be served; code is an error
    class's `code`."""

    code: str = Field(max_length=64)
    message: str
    request_id: str | None = Field(default=None, max_length=MAX_ID_LEN)
    incarnation: Incarnation = ""  # the sender's, on the KV link: an error from another one is a stale link

    @classmethod
    def from_exception(cls, exc: BaseException) -> Error:
        request_id = getattr(exc, "request_id", None)
        return cls(code=str(getattr(exc, "code", "internal_error"))[:64], message=str(exc)[:MAX_STR_LEN],
                   request_id=request_id if isinstance(request_id, str) and len(request_id) <= MAX_ID_LEN else None)
