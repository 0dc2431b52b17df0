"""Prompt logprobs: which rows of a step's hidden states give a request's prompt logprobs, the tables
computed from them, and their gathering over a prompt's chunks.

The hidden state at prompt position p predicts prompt token p + 1, so a prompt of n tokens has n - 1
rows of logprobs; table row i is prompt position i + 1. A request's tables (control/messages.py's
PromptLogprobs layout):
    token_ids  int32   [rows, 1 + k]  column 0 the prompt token, then the top k by logprob
    logprobs   float32 [rows, 1 + k]  of the raw logits, as the sampler's logprobs
    ranks      int32   [rows]         the prompt token's rank in the vocabulary, 1 = likeliest
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request

FLOAT32_MAX = torch.finfo(torch.float32).max
# Rows whose [rows, vocab] logits are made at once: 256 rows of a 152k vocabulary are 156 MB of float32.
ROWS_PER_PASS = 256

Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # token_ids, logprobs, ranks (CPU)


@dataclass
class PromptRows:
    """The hidden rows of one step that give `request` prompt logprobs: rows [first_row, first_row +
    len(targets)), predicting the prompt tokens `targets`."""

    request: Request
    first_row: int
    targets: list[int]


def rows_of_chunk(request: Request, start: int, end: int, first_row: int) -> PromptRows | None:
    """The prompt-logprob rows of a chunk that runs positions [start, end) of `request` in hidden rows
    [first_row, first_row + end - start); None when it has none. Positions already covered (a prompt
    recomputed after a preemption) are not computed again."""
    if not request.wants_prompt_logprobs:
        return None
    covered = request.num_prompt_logprob_positions  # positions 0 .. covered - 1 have their row
    low, high = max(start, covered), min(end, request.num_prompt_tokens - 1)
    if low >= high:  # no prompt position left in this chunk (a decode engine given the prompt's KV: its
        return None  # prefill engine sent them)
    if start > covered:
        raise RuntimeError(f"request {request.request_id} computes prompt position {start} before "
                           f"{covered}: its prompt logprobs would have a gap")
    return PromptRows(request, first_row + low - start, request.prompt_token_ids[low + 1:high + 1])


def compute(model: torch.nn.Module, hidden: torch.Tensor, rows: list[PromptRows]) -> dict[str, Tables]:
    """{request id: its tables for this step} from the step's hidden states [T, hidden]."""
    tables = {}
    for item in rows:
        num_top = item.request.sampling_params.prompt_logprobs
        targets = torch.tensor(item.targets, dtype=torch.int64, device=hidden.device)
        parts = []
        for first in range(0, len(item.targets), ROWS_PER_PASS):
            count = min(ROWS_PER_PASS, len(item.targets) - first)
            part_hidden = hidden.narrow(0, item.first_row + first, count)  # [count, hidden]
            parts.append(_tables(model.compute_logits(part_hidden), targets[first:first + count], num_top))
        tables[item.request.request_id] = tuple(torch.cat(columns) for columns in zip(*parts))
    return tables


def _tables(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> Tables:
    """Logits [m, V] and the prompt tokens [m] they predict -> the tables' m rows. Log-probs are logits less
    their logsumexp, taken for the few entries kept: a whole [m, V] log-softmax cost a third more here."""
    logits = logits.float()
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)  # [m, 1]
    target_logits = logits.gather(1, targets[:, None])  # [m, 1]
    ranks = torch.gt(logits, target_logits).sum(dim=-1, dtype=torch.int32) + 1  # [m]
    top_logits, top_ids = logits.topk(min(num_top, logits.shape[1]), dim=-1)  # [m, k]
    token_ids = torch.cat([targets[:, None], top_ids], dim=1).to(torch.int32)  # [m, 1 + k]
    values = torch.cat([target_logits, top_logits], dim=1) - log_total  # [m, 1 + k]
    # finite, as the sampler's logprobs: an impossible token (or a NaN row) gets the lowest float32
    values = values.nan_to_num_(nan=-FLOAT32_MAX, neginf=-FLOAT32_MAX, posinf=0.0)
    return token_ids.cpu(), values.cpu(), ranks.cpu()


def join(parts: list[Tables]) -> Tables:
    """A prompt's chunks' tables (Request.add_prompt_logprobs) as one set."""
    return tuple(torch.cat(columns) for columns in zip(*parts))


def as_dicts(tables: Tables) -> list[dict[int, float] | None]:
    """[None, {prompt token: logprob, top ids...: logprob}, ...]: the offline API's shape (the sampled
    tokens' logprobs have it too)."""
    token_ids, logprobs, _ = tables
    rows: list[dict[int, float] | None] = [None]
    for ids, values in zip(token_ids.tolist(), logprobs.tolist()):
        rows.append(dict(zip(ids, values)))  # the prompt token may be among the top: same id, same value
    return rows
