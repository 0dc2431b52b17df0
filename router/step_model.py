"""The step-time model the adaptive policy predicts with: a `pdserve profile` JSON's three fits, read here
(the router does not import the planner), or the built-in CPU demo-model figures.

    prefill step  = p0 + p_token * tokens + p_attention * sum of L^2 over the step's prompts
    decode step   = d0 + d_seq * batch + d_context * context tokens attended
    KV transfer   = t0 + kv_bytes_per_token * tokens * t_byte

`calibrated(model, step_times)` scales the prefill and decode fits by the engines' measured step times over
these predictions of them (EngineStats.step_times), each ratio bounded to [MIN_SPEED_RATIO, MAX_SPEED_RATIO].
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pdserve.control.messages import StepTimes

MIN_SPEED_RATIO, MAX_SPEED_RATIO = 0.25, 4.0  # measured over predicted step time, as far as it is trusted
MIN_STEPS = 5.0  # decayed steps of a kind below which its ratio stays 1


@dataclass(frozen=True)
class StepModel:
    prefill_intercept: float = 0.048  # seconds; defaults: the 2-core CPU demo model's profile (docs/design/adaptive.md)
    prefill_per_token: float = 0.003
    prefill_attention: float = 6.8e-7  # per L^2
    decode_intercept: float = 0.045
    decode_per_seq: float = 0.0036
    decode_per_context_token: float = 9.7e-6
    transfer_intercept: float = 0.001
    transfer_per_byte: float = 1.1e-9
    kv_bytes_per_token: int = 46080
    max_num_batched_tokens: int = 2048

    def prefill_s(self, num_tokens: int, sum_squares: float | None = None, num_prompts: int = 1) -> float:
        """Seconds to compute num_tokens prompt tokens (num_prompts prompts whose squared lengths sum to
        sum_squares; default one prompt), in steps of at most max_num_batched_tokens."""
        if num_tokens <= 0:
            return 0.0
        squares = float(num_tokens) ** 2 if sum_squares is None else sum_squares
        num_steps = max(num_prompts, math.ceil(num_tokens / self.max_num_batched_tokens))
        return (num_steps * self.prefill_intercept + self.prefill_per_token * num_tokens
                + self.prefill_attention * squares)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of `batch` sequences attending context_tokens in all (0 for no batch)."""
        if batch <= 0:
            return 0.0
        return self.decode_intercept + self.decode_per_seq * batch + self.decode_per_context_token * context_tokens

    def decode_part_s(self, batch: int, context_tokens: int) -> float:
        """What `batch` decodes add to a step that computes prompt tokens too (the step's fixed part is paid once)."""
        if batch <= 0:
            return 0.0
        return self.decode_per_seq * batch + self.decode_per_context_token * context_tokens

    def transfer_s(self, num_tokens: int) -> float:
        return self.transfer_intercept + self.transfer_per_byte * self.kv_bytes_per_token * max(num_tokens, 0)

    def scaled(self, prefill_ratio: float, decode_ratio: float) -> StepModel:
        """This model with its prefill fit times prefill_ratio and its decode fit times decode_ratio."""
        if prefill_ratio == 1.0 and decode_ratio == 1.0:
            return self
        return dataclasses.replace(
            self, prefill_intercept=self.prefill_intercept * prefill_ratio,
            prefill_per_token=self.prefill_per_token * prefill_ratio,
            prefill_attention=self.prefill_attention * prefill_ratio,
            decode_intercept=self.decode_intercept * decode_ratio, decode_per_seq=self.decode_per_seq * decode_ratio,
            decode_per_context_token=self.decode_per_context_token * decode_ratio)


def speed_ratios(model: StepModel, step_times: Iterable[StepTimes]) -> tuple[float, float]:
    """(prefill, decode): the engines' measured step seconds over the model's prediction of the same steps, summed
    over engines. A prompt step's decodes are priced at the decode ratio, the rest of it gives the prefill one."""
    measured_decode = predicted_decode = measured_prompt = predicted_prompt = riding = 0.0
    decode_steps = prompt_steps = 0.0
    for times in step_times:
        measured_decode += times.decode_seconds
        predicted_decode += (model.decode_intercept * times.decode_steps + model.decode_per_seq * times.decode_seqs
                             + model.decode_per_context_token * times.decode_context_tokens)
        measured_prompt += times.prompt_seconds
        predicted_prompt += (model.prefill_intercept * times.prompt_steps + model.prefill_per_token
                             * times.prompt_tokens + model.prefill_attention * times.prompt_squares)
        riding += (model.decode_per_seq * times.prompt_decode_seqs
                   + model.decode_per_context_token * times.prompt_decode_context_tokens)
        decode_steps += times.decode_steps
        prompt_steps += times.prompt_steps
    decode = _bounded(measured_decode, predicted_decode) if decode_steps >= MIN_STEPS else 1.0
    prefill = _bounded(measured_prompt - decode * riding, predicted_prompt) if prompt_steps >= MIN_STEPS else 1.0
    return prefill, decode


def _bounded(measured: float, predicted: float) -> float:
    if predicted <= 0:
        return 1.0
    return min(max(measured / predicted, MIN_SPEED_RATIO), MAX_SPEED_RATIO)


def calibrated(model: StepModel, step_times: Iterable[StepTimes]) -> StepModel:
    """The model scaled to the engines' measured speed (speed_ratios)."""
    return model.scaled(*speed_ratios(model, step_times))


def load_step_model(path: str | Path) -> StepModel:
    """The fits of a `pdserve profile` JSON; a ValueError naming the problem and the fix."""
    try:
        profile = json.loads(Path(path).read_text())
        prefill = profile["prefill_fit"]["coefficients"]
        decode = profile["decode_fit"]["coefficients"]
        transfer = profile["transfer_fit"]["coefficients"]
        model = StepModel(
            prefill_intercept=prefill.get("intercept", 0.0), prefill_per_token=prefill.get("tokens", 0.0),
            prefill_attention=prefill.get("attention", 0.0), decode_intercept=decode.get("intercept", 0.0),
            decode_per_seq=decode.get("batch", 0.0), decode_per_context_token=decode.get("context", 0.0),
            transfer_intercept=transfer.get("intercept", 0.0), transfer_per_byte=transfer.get("bytes", 0.0),
            kv_bytes_per_token=int(profile["model"]["kv_bytes_per_token"]),
            max_num_batched_tokens=int(profile.get("engine", {}).get("max_num_batched_tokens", 2048)))
    except OSError as exc:
        raise ValueError(f"--step-profile {path}: cannot read it ({exc.strerror}): give a `pdserve profile` JSON") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--step-profile {path}: not a `pdserve profile` JSON ({type(exc).__name__}: {exc}): "
                         "make one with `pdserve profile`") from None
    numbers = [value for value in vars(model).values()]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in numbers) \
            or model.max_num_batched_tokens < 1:
        raise ValueError(f"--step-profile {path}: a fit coefficient is negative or not a finite number: profile the "
                         "engine again with `pdserve profile`")
    return model
