"""StepTimer: an engine's recent steps, measured, as the time-decayed sums of control.messages.StepTimes (the
adaptive router compares them with its step model's predictions). Each step of a kind scales that kind's sums
by 1 - WEIGHT before it is added, so the sums speak for about 1 / WEIGHT recent steps."""

from __future__ import annotations

from pdserve.control.messages import StepTimes
from pdserve.engine.scheduler import SchedulerOutput

WEIGHT = 0.02  # of each step in its kind's sums


class StepTimer:
    def __init__(self) -> None:
        self._decode = [0.0] * 4  # seconds, steps, sequences, context tokens
        self._prompt = [0.0] * 6  # seconds, steps, prompt tokens, their squares, decodes riding along, their context

    def features(self, plan: SchedulerOutput) -> tuple[float, ...]:
        """What the step model prices in a step, read before it runs: (sequences decoded, their context tokens,
        prompt tokens, their squares); the squares of a chunk of n after c computed tokens: (c + n)^2 - c^2."""
        decodes, chunks = plan.scheduled[:plan.num_decodes], plan.scheduled[plan.num_decodes:]
        context = sum(item.request.num_computed_tokens + item.num_new_tokens for item in decodes)
        tokens = sum(item.num_new_tokens for item in chunks)
        squares = sum(item.num_new_tokens * (2 * item.request.num_computed_tokens + item.num_new_tokens)
                      for item in chunks)
        return float(len(decodes)), float(context), float(tokens), float(squares)

    def record(self, features: tuple[float, ...], seconds: float) -> None:
        seqs, context, tokens, squares = features
        if tokens:
            _decay_add(self._prompt, (seconds, 1.0, tokens, squares, seqs, context))
        elif seqs:
            _decay_add(self._decode, (seconds, 1.0, seqs, context))

    def snapshot(self) -> StepTimes:
        decode, prompt = self._decode, self._prompt
        return StepTimes(decode_seconds=decode[0], decode_steps=decode[1], decode_seqs=decode[2],
                         decode_context_tokens=decode[3], prompt_seconds=prompt[0], prompt_steps=prompt[1],
                         prompt_tokens=prompt[2], prompt_squares=prompt[3], prompt_decode_seqs=prompt[4],
                         prompt_decode_context_tokens=prompt[5])


def _decay_add(sums: list[float], values: tuple[float, ...]) -> None:
    for index, value in enumerate(values):
        sums[index] = sums[index] * (1.0 - WEIGHT) + value
