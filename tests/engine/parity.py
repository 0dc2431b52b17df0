"""Greedy parity with transformers' generate(), with the tie rule of the foundation issue."""

from __future__ import annotations

import torch

TIE_GAP = 1e-3


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


LOGPROB_TOLERANCE = 1e-4
HALF_PRECISION_ULPS = 2  # in bf16/fp16, logits may differ by this many units in the last place of the largest


def _tolerance(floor: float, logits: torch.Tensor, dtype: torch.dtype) -> float:
    """floor, or HALF_PRECISION_ULPS rounding steps of the largest logit in `dtype` when that is more
    (bf16 keeps 8 significant bits: a logit near 16 moves in steps of 0.125)."""
    return max(floor, HALF_PRECISION_ULPS * torch.finfo(dtype).eps * float(logits.float().abs().max()))


def assert_greedy_match(ours: list[int], theirs: list[int], logits: list[torch.Tensor], label: str,
                        our_logprobs: list[dict[int, float]] | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Equal token for token; at the first difference, transformers' top-2 logits must be a near tie
    and pdserve's token transformers' second choice (then the continuations legitimately diverge and
    comparison stops). With our_logprobs, each
    chosen token's logprob must also equal transformers' log_softmax (catches small numeric bugs that
    do not flip an argmax). In half precision (dtype) both tolerances widen to HALF_PRECISION_ULPS
    rounding steps of the largest logit, since pdserve and transformers round in different places."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            if our_logprobs is not None:
                expected = float(torch.log_softmax(logits[step].float(), -1)[a])
                got = our_logprobs[step][a]
                assert abs(got - expected) < _tolerance(LOGPROB_TOLERANCE, logits[step], dtype), (
                    f"{label}: step {step} logprob of token {a} is {got:.6f}, transformers {expected:.6f}"
                )
            continue
        top2 = torch.topk(logits[step].float(), 2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < _tolerance(TIE_GAP, logits[step], dtype), f"{label}: step {step} pdserve chose {a}, transformers {b} (top-2 gap {gap:.2e})"
        runner_up = logits[step].float().clone()
        runner_up[b] = float("-inf")  # transformers' second choice: the best token but its own (any of an exact tie)
        assert float(runner_up[a]) == float(runner_up.max()), (
            f"{label}: step {step} pdserve chose {a}, which is not transformers' second choice "
            f"{int(runner_up.argmax())} of the near tie"
        )
        return
    assert len(ours) == len(theirs), f"{label}: {len(ours)} tokens vs transformers' {len(theirs)}"
