"""What the Triton attention kernels take for sliding windows, logit soft-capping and sinks: the checked
launch arguments, and the soft cap in the kernels' log2 domain."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_utils import LOG2E

LOG2E_CONST = tl.constexpr(LOG2E)  # for jit code, which reads only constexpr globals


@dataclass(frozen=True)
class AttentionOptions:
    window: int  # 0: no window
    cap_in: float  # a soft-capped logit is cap_out * tanh(q.k * cap_in), in the log2 domain
    cap_out: float
    sinks: torch.Tensor  # [num_heads] float32; the query when there are none (never read)
    has_sinks: bool

    @property
    def has_window(self) -> bool:
        return self.window > 0

    @property
    def has_soft_cap(self) -> bool:
        return self.cap_out > 0

    @classmethod
    def checked(cls, sliding_window: int | None, soft_cap: float | None, sinks: torch.Tensor | None,
                query: torch.Tensor, scale: float) -> AttentionOptions:
        """ValueError naming the argument when one is malformed; query [T, num_heads, head_dim]."""
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window={sliding_window!r} must be a positive int, or None for no window")
        if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
            raise ValueError(f"soft_cap={soft_cap!r} must be a positive number, or None for no cap")
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (query.shape[1],):
                shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
                raise ValueError(f"sinks has shape {shape}; expected ({query.shape[1]},) (one logit per query head)")
            if sinks.device != query.device:
                raise ValueError(f"sinks is on {sinks.device}, query on {query.device}: move sinks to the query's")
        cap = float(soft_cap) if soft_cap is not None else 0.0
        return cls(
            window=sliding_window or 0,
            cap_in=float(scale) / cap if cap else 0.0,
            cap_out=cap * LOG2E,
            sinks=sinks.float().contiguous() if sinks is not None else query,
            has_sinks=sinks is not None,
        )


@triton.jit
def soft_cap_logits(dots, cap_in, cap_out):
    """cap * tanh(scale * q.k / cap) * log2(e), with tanh(x) = 1 - 2 / (exp(2x) + 1) (finite at any x)."""
    return cap_out * (1.0 - 2.0 / (tl.exp(2.0 * cap_in * dots) + 1.0))
