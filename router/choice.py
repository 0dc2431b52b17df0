"""What one choice of a request is, and what its runner yields: ChoiceSpec in, ChoiceDelta (or Restarted) out.

A choice that asks for prompt logprobs gets them on its first delta; with n > 1 only sample 0 asks the
engines, and the prompt's other samples take sample 0's set (SharedPromptLogprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.control.prompt_logprobs import PositionLogprobs
from pdserve.control.sampling_params import SamplingParams

# A prompt's logprobs as the client gets them: [None, position 1, ..., position n - 1] (the first token has none)
PromptRows = list[PositionLogprobs | None]

SHARED = "shared"  # the source of the item SharedPromptLogprobs puts in a waiting sample's inbox


class SharedPromptLogprobs:
    """The prompt logprobs of one prompt with n > 1 samples: sample 0 asks the engines and sets them; each
    other sample reads `rows`, or, when its first token comes before them, is told (SHARED) once they are set."""

    def __init__(self) -> None:
        self.rows: PromptRows | None = None
        self._inboxes: list[Any] = []

    def notify(self, inbox: Any) -> None:
        """Put (SHARED, None) in `inbox` once the rows are set."""
        self._inboxes.append(inbox)

    def set(self, rows: PromptRows) -> None:
        self.rows = rows
        for inbox in self._inboxes:
            inbox.put(SHARED, None)


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # sent to the engines as it is; its stop strings are applied by the router
    prompt_only: bool = False  # max_tokens=0 with echo: the engines make one token, which is dropped
    shared_prompt_logprobs: SharedPromptLogprobs | None = None  # n > 1 and prompt logprobs asked: one per prompt

    @property
    def reports_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None or self.shared_prompt_logprobs is not None

    @property
    def asks_engines_for_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None


@dataclass
class ChoiceDelta:
    """What one engine delta adds to a choice, as the client will see it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # the engine's prefix-cache hit, reported with the first token
    prompt_logprobs: PromptRows | None = None  # on the choice's first delta, when it asked for them


@dataclass(frozen=True)
class Restarted:
    """Yielded by a restartable runner that starts a choice over: drop what was gathered for it."""

    index: int
