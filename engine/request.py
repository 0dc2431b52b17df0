"""Requests and their sampling parameters, counted in tokens (no "phase": only num_computed_tokens)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request that can never be served as given; the message says what to change."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs, named and defaulted like vLLM's `SamplingParams`.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n == 1, f"n={self.n}: only n=1 is supported; send several requests instead"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 is greedy)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"),
            (self.top_k >= -1, f"top_k={self.top_k} must be -1 or 0 (disabled) or a positive count"),
            (0 <= self.min_p <= 1, f"min_p={self.min_p} must be in [0, 1]"),
            (self.repetition_penalty > 0, f"repetition_penalty={self.repetition_penalty} must be > 0"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty={self.presence_penalty} must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens > 0,
             f"max_tokens={self.max_tokens} must be a positive number of tokens to generate"),
            (self.min_tokens >= 0, f"min_tokens={self.min_tokens} must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs={self.logprobs} must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass
class Request:
    """One generation request as the scheduler and KV cache manager see it.

    all_token_ids = prompt_token_ids + output_token_ids. num_computed_tokens counts the tokens whose
    KV is in the cache (or will be after the step in flight).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved from sampling_params and the context length by the engine
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until known
    num_external_computed_tokens: int = 0  # tokens whose KV comes from a remote prefill
    num_preemptions: int = 0
    # Decode role of disaggregation: the prefill engine's KV link address, or None to prefill locally.
    prefill_kv_address: str | None = None
    allow_remote_prefill: bool = True  # cleared when a remote prefill failed and the request recomputes
    stop_reason: int | str | None = None
    # Filled by the KV cache manager: hash of each full block of all_token_ids, in order.
    block_hashes: list = field(default_factory=list)
    # One entry per output token when sampling_params.logprobs is set: {token_id: logprob}.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    error: str | None = None
    # prompt + output, kept as one list so per-step lookups do not copy it; only append through
    # append_output_token().
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
