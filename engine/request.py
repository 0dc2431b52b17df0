"""Requests counted in tokens (no "phase": only num_computed_tokens). A request's SamplingParams and
the InvalidRequestError that refuses it are the wire's (control.sampling_params, control.errors): the
engine takes them as the router sent them; this module names them for the engine and pdserve."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.control.errors import InvalidRequestError
from pdserve.control.sampling_params import SamplingParams

__all__ = ["InvalidRequestError", "Request", "RequestStatus", "SamplingParams"]


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

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

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until known
    num_external_computed_tokens: int = 0  # tokens whose KV comes from a remote prefill
    num_preemptions: int = 0
    # Decode role of disaggregation: the prefill engine's KV link address, or None to prefill locally.
    prefill_kv_address: str | None = None
    allow_remote_prefill: bool = True  # cleared when a remote prefill failed and the request recomputes
    # The most prompt tokens one step computes for it (None: the step's budget): a smaller chunk for a request
    # whose prompt KV was to arrive and that fits the cache only in smaller chunks when it prefills here.
    max_chunk_tokens: int | None = None
    # Decode role: the first token (and its logprobs) the prefill engine sampled and the client already has;
    # a local prefill emits it instead of its own sample.
    prefill_first_token: tuple[int, dict[int, float] | None] | None = None
    stop_reason: int | str | None = None
    # Filled by the KV cache manager: hash of each full block of all_token_ids, in order.
    block_hashes: list = field(default_factory=list)
    # One entry per output token when sampling_params.logprobs is set: {token_id: logprob}.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    error: str | None = None
    # When sampling_params.prompt_logprobs is set: the prompt's tables so far, one part per prompt chunk
    # (engine/prompt_logprobs.py), and how many positions they cover (the prompt's n - 1 when complete).
    prompt_logprob_parts: list = field(default_factory=list)
    # With a structured-output constraint: its matcher (engine/structured_output.py GrammarState), which
    # every output token goes through.
    grammar: Any = None
    num_prompt_logprob_positions: int = 0
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
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions whose logprobs are still to be computed."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.num_prompt_logprob_positions < self.num_prompt_tokens - 1)

    def add_prompt_logprobs(self, tables: tuple) -> list[tuple] | None:
        """Keep one prompt chunk's prompt-logprob tables (engine/prompt_logprobs.py); all of the prompt's
        once its last chunk is in, else None."""
        self.prompt_logprob_parts.append(tables)
        self.num_prompt_logprob_positions += len(tables[2])
        if self.wants_prompt_logprobs:
            return None
        parts, self.prompt_logprob_parts = self.prompt_logprob_parts, []
        return parts

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
