"""Prompt logprobs on the wire: an engine's [num_positions, width] tables cut into PromptLogprobs messages
(control/messages.py) of at most MAX_PROMPT_LOGPROB_ENTRIES entries, and read back as one dict per prompt
position. Torch-free: the engine passes CPU tensors, which `encode` sends without a copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.control.errors import ProtocolError
from pdserve.control.messages import MAX_PROMPT_LOGPROB_ENTRIES, PromptLogprobs

# One prompt position: {token id: (logprob, rank)}, the prompt token first, then the top-N by logprob.
PositionLogprobs = dict[int, tuple[float, int]]


def pack(request_id: str, token_ids: Any, logprobs: Any, ranks: Any) -> list[tuple[PromptLogprobs, tuple]]:
    """The messages (with their payload buffers) that carry a prompt's tables, in order.

    token_ids int32 [P, W], logprobs float32 [P, W], ranks int32 [P] (CPU tensors or numpy arrays), row i
    being prompt position i + 1. Send each as `send(msg, *buffers)`."""
    num_positions, width = token_ids.shape
    rows_per_message = MAX_PROMPT_LOGPROB_ENTRIES // width
    messages = []
    for first in range(0, num_positions, rows_per_message):
        end = min(first + rows_per_message, num_positions)
        msg = PromptLogprobs(request_id=request_id, start=first + 1, num_positions=end - first, width=width,
                             last=end == num_positions)
        messages.append((msg, (token_ids[first:end], logprobs[first:end], ranks[first:end])))
    return messages


def read(msg: PromptLogprobs, frames: list[memoryview]) -> list[PositionLogprobs]:
    """One dict per position of `msg`, from its verified frames (decode checked their sizes)."""
    ids = frames[0].cast("i")
    values = frames[1].cast("f")
    ranks = frames[2].cast("i")
    width = msg.width
    rows = []
    for row in range(msg.num_positions):
        base = row * width
        entry = {ids[base]: (values[base], ranks[row])}
        for column in range(1, width):
            entry.setdefault(ids[base + column], (values[base + column], column))
        rows.append(entry)
    return rows


@dataclass
class PromptLogprobsAssembler:
    """A request's PromptLogprobs messages gathered into [None, position 1, ..., position n - 1] (vLLM's
    shape: the first prompt token has no logprob). Chunks must come in order, without gaps."""

    num_prompt_tokens: int
    rows: list[PositionLogprobs | None] | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self.rows = [None]
        self.done = self.num_prompt_tokens <= 1  # a one-token prompt has no position to send

    @property
    def result(self) -> list[PositionLogprobs | None] | None:
        """The whole list once every position came, else None."""
        return self.rows if self.done else None

    def add(self, msg: PromptLogprobs, rows: list[PositionLogprobs]) -> None:
        if self.done:  # a second engine computed them again (a KV failure recomputed): the first set stands
            return
        if msg.start == 1:  # a retry elsewhere starts over (the engine that failed may have sent some)
            self.rows = [None]
        if msg.start != len(self.rows):
            raise ProtocolError(f"prompt logprobs of {msg.request_id} start at position {msg.start}, "
                                f"expected {len(self.rows)}: chunks came out of order")
        self.rows.extend(rows)
        if msg.last:
            if len(self.rows) != self.num_prompt_tokens:
                raise ProtocolError(f"prompt logprobs of {msg.request_id} cover {len(self.rows)} positions, "
                                    f"the prompt has {self.num_prompt_tokens}")
            self.done = True
