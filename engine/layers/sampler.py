"""One token per sequence from a step's logits: penalties, min_tokens, greedy or temperature /
min-p / top-k / top-p sampling with stateless per-request seeds, and logprobs, vectorized over the
batch (pipeline and choices: docs/serving/sampling.md)."""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.request import Request, SamplingParams

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
MIN_TEMPERATURE = 1e-5
# Largest float32: +inf logits are clamped to it, so a row's arithmetic stays finite.
_FLOAT32_MAX = torch.finfo(torch.float32).max
# Tokens per block of the two-level inverse CDF used to draw tokens.
_CDF_BLOCK = 1024
_UINT64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: None when the request did not ask for logprobs, else {token_id: logprob} holding the
    # sampled token and the request's top-N tokens, logprobs of the raw logits.
    logprobs: list[dict[int, float] | None]


class Sampler:
    """`Sampler()(logits, requests)`: row i of logits [num_seqs, vocab_size] is requests[i]'s."""

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        _check_batch(logits, requests)
        if not requests:
            return SamplerOutput(token_ids=[], logprobs=[])
        if all(_is_plain_greedy(request) for request in requests):
            return SamplerOutput(greedy_tokens(logits).tolist(), [None] * len(requests))
        processed = _processed_logits(logits, requests)  # [num_seqs, vocab_size] float32
        token_ids = _choose_tokens(processed, requests)  # [num_seqs] int64
        logprobs = compute_logprobs(logits, token_ids, requests)
        return SamplerOutput(token_ids.tolist(), logprobs)


# --------------------------------------------------------------------------- batch checks


def _check_batch(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit {len(requests)} requests: pass "
            "[num_seqs, vocab_size] logits with row i belonging to requests[i]"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits have dtype {logits.dtype}: pass floating-point logits")


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _min_tokens_ban(request: Request) -> list[int]:
    """Token ids the request may not produce yet because it has fewer than min_tokens outputs."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if request.eos_token_id is not None and not params.ignore_eos:
        banned.append(request.eos_token_id)
    return banned


def _is_plain_greedy(request: Request) -> bool:
    """Greedy with nothing that changes or reports the logits: the argmax fast path applies."""
    params = request.sampling_params
    return (
        _is_greedy(params)
        and params.logprobs is None
        and not _has_penalties(params)
        and not params.logit_bias
        and not _min_tokens_ban(request)
    )


# --------------------------------------------------------------------------- logits processors


def _processed_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """A float32 copy of logits after penalties and min_tokens, +inf clamped to the largest float32
    so that later steps stay finite. NaN stays NaN: a sampled row holding one is an error."""
    processed = logits.to(torch.float32, copy=True)
    if any(_has_penalties(r.sampling_params) or r.sampling_params.logit_bias or _min_tokens_ban(r) for r in requests):
        apply_logits_processors(processed, requests)
    return processed.clamp_(max=_FLOAT32_MAX)


def apply_logits_processors(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Penalties, logit_bias, then min_tokens masking, in place on float32 logits [num_seqs, vocab_size]."""
    apply_repetition_penalty(logits, requests)
    apply_presence_frequency_penalties(logits, requests)
    apply_logit_bias(logits, requests)
    apply_min_tokens(logits, requests)
    return logits


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """OpenAI's logit_bias: each (token id, bias) of a request added to that token's logit."""
    rows, token_ids, biases = [], [], []
    for row, request in enumerate(requests):
        for token_id, bias in request.sampling_params.logit_bias:
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Over prompt and output tokens: positive logits divided by the penalty, others multiplied."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
    if not rows:
        return
    index, num_occurrences = _occurrences(logits, requests, rows, prompt=True)
    penalty = _per_occurrence(requests, rows, "repetition_penalty", num_occurrences, logits.device)
    picked = logits[index]  # [num_occurrences]; a repeated token reads and writes the same value
    logits[index] = torch.where(picked > 0, picked / penalty, picked * penalty)


def apply_presence_frequency_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """OpenAI semantics over output tokens: logit -= frequency * count + presence * (count > 0)."""
    rows = [
        i
        for i, r in enumerate(requests)
        if r.sampling_params.presence_penalty != 0.0 or r.sampling_params.frequency_penalty != 0.0
    ]
    if not rows:
        return
    index, num_occurrences = _occurrences(logits, requests, rows, prompt=False)
    frequency = _per_occurrence(requests, rows, "frequency_penalty", num_occurrences, logits.device)
    presence = _per_occurrence(requests, rows, "presence_penalty", num_occurrences, logits.device)
    logits.index_put_(index, -frequency, accumulate=True)  # once per occurrence
    logits[index] = logits[index] - presence  # once per distinct token


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Stop ids (and eos unless ignore_eos) get -inf while a request has fewer than min_tokens."""
    vocab_size = logits.shape[1]
    row_ids, token_ids = [], []
    for row, request in enumerate(requests):
        for token_id in _min_tokens_ban(request):
            if 0 <= token_id < vocab_size:
                row_ids.append(row)
                token_ids.append(token_id)
    if row_ids:
        device = logits.device
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        logits[index] = -math.inf


def _occurrences(
    logits: torch.Tensor, requests: Sequence[Request], rows: list[int], prompt: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Every (row, token id) occurrence in the rows' output (and prompt) tokens, as an index pair
    of [num_occurrences] int64 tensors, and the number of occurrences of each row [len(rows)]."""
    flat = array.array("q")
    lengths = []
    for i in rows:
        tokens = requests[i].all_token_ids if prompt else requests[i].output_token_ids
        flat.extend(tokens)
        lengths.append(len(tokens))
    no_tokens = torch.zeros(0, dtype=torch.long)
    token_ids = torch.frombuffer(flat, dtype=torch.int64) if flat else no_tokens  # [n]
    vocab_size = logits.shape[1]
    if flat and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        _raise_out_of_vocab([requests[i] for i in rows], vocab_size)
    num_occurrences = torch.tensor(lengths)
    row_ids = torch.tensor(rows).repeat_interleave(num_occurrences)  # [num_occurrences]
    return (row_ids.to(logits.device), token_ids.to(logits.device)), num_occurrences


def _per_occurrence(
    requests: Sequence[Request], rows: list[int], name: str, num_occurrences: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:  # [num_occurrences] float32: sampling_params.<name> of each occurrence's row
    values = [float(getattr(requests[i].sampling_params, name)) for i in rows]
    per_row = torch.tensor(values, dtype=torch.float32)
    return per_row.repeat_interleave(num_occurrences).to(device)


def _raise_out_of_vocab(requests: list[Request], vocab_size: int) -> None:
    for request in requests:
        bad = [t for t in request.all_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"request {request.request_id!r} holds token id {bad[0]} outside the model's "
                f"vocabulary [0, {vocab_size}): send token ids produced by this model's tokenizer"
            )


# --------------------------------------------------------------------------- choosing tokens


ARGMAX_CHUNK = 1024  # positions of a row whose maximum one vectorised amax takes, in greedy_tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [num_seqs, V] -> [num_seqs] int64
    """logits.argmax(dim=-1), the same indices (the first maximum; NaN counts as the largest), through vectorised
    chunk maxima on the CPU, where torch's argmax walks a row one element at a time (5x slower at a 49k vocabulary)."""
    rows, vocab = logits.shape
    whole = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    if logits.device.type != "cpu" or whole < 8 * ARGMAX_CHUNK or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    chunks = logits[:, :whole].unflatten(1, (-1, ARGMAX_CHUNK))  # [S, n, C]
    chunk_max = chunks.amax(dim=-1)  # [S, n]
    best = chunk_max.argmax(dim=-1)  # [S]: the first chunk that holds the row's maximum
    every_row = torch.arange(rows, device=logits.device)
    token_ids = best * ARGMAX_CHUNK + chunks[every_row, best].argmax(dim=-1)
    if whole < vocab:  # the tail past the last whole chunk wins only with a larger value (or the first NaN)
        tail_max, tail_index = logits[:, whole:].max(dim=-1)
        head_max = chunk_max[every_row, best]
        later = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan())
        token_ids = torch.where(later, whole + tail_index, token_ids)
    return token_ids


def _choose_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Processed logits [num_seqs, V] -> token ids [num_seqs]: greedy rows argmax, others draw."""
    sampled_rows = [i for i, r in enumerate(requests) if not _is_greedy(r.sampling_params)]
    if not sampled_rows:
        return greedy_tokens(logits)
    if len(sampled_rows) == len(requests):
        return _sample_rows(logits, requests)
    token_ids = greedy_tokens(logits)  # [num_seqs]; sampled rows are overwritten below
    row_index = torch.tensor(sampled_rows, device=logits.device)
    token_ids[row_index] = _sample_rows(logits[row_index], [requests[i] for i in sampled_rows])
    return token_ids


def _sample_rows(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Logits [R, V] of non-greedy rows -> one drawn token id per row [R]."""
    params = [r.sampling_params for r in requests]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    # Shifted by the row's max before dividing: the result is <= 0, so no temperature overflows it.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]  # [R, V]
    cutoff = min_p_top_k_cutoff(scaled, [p.min_p for p in params], [p.top_k for p in params])
    if cutoff is not None:
        scaled.masked_fill_(scaled < cutoff, -math.inf)
    # softmax, not exp: torch.exp is many times slower on inputs that underflow, such as -inf.
    weights = torch.softmax(scaled, dim=-1)  # [R, V] probabilities, 0 where masked
    return draw_tokens(weights, [p.top_p for p in params], RowRandom(requests, device))


def min_p_top_k_cutoff(
    logits: torch.Tensor, min_p: list[float], top_k: list[int]
) -> torch.Tensor | None:
    """Smallest logit each row of logits [R, V] keeps under min_p and top-k [R, 1]; None if none
    filters. Ties with the cutoff are kept, so top-k may keep more than k tied tokens.

    min_p: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p).
    top-k: logit_i < the row's k-th largest logit. Applying both cutoffs equals applying top-k
    after min_p: a token min_p drops can only move the k-th largest survivor down to -inf.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    min_p_rows = any(p > 0.0 for p in min_p)
    top_k_rows = [i for i, k in enumerate(top_k) if 0 < k < vocab_size]
    if not min_p_rows and not top_k_rows:
        return None
    cutoff = torch.full((num_rows, 1), -math.inf, device=device)  # [R, 1]
    if min_p_rows:
        log_min_p = torch.tensor(min_p, dtype=torch.float32, device=device).log()[:, None]
        cutoff = logits.max(dim=-1, keepdim=True).values + log_min_p  # log(0) = -inf keeps all
    if top_k_rows:
        picked = logits if len(top_k_rows) == num_rows else logits[top_k_rows]  # [K, V]
        k = torch.tensor([top_k[i] for i in top_k_rows], device=device)  # [K]
        values = picked.topk(int(k.max()), dim=-1).values  # [K, max_k], descending
        kth = values.gather(1, (k - 1)[:, None])  # [K, 1]
        cutoff[top_k_rows] = torch.maximum(cutoff[top_k_rows], kth)
    return cutoff


def draw_tokens(weights: torch.Tensor, top_p: list[float], rng: RowRandom) -> torch.Tensor:
    """One token per row from probabilities [R, V] (need not sum to 1), within its top-p nucleus.

    The nucleus of a row is every token whose strictly more probable tokens hold less than top_p of
    the mass (ties with the last token are kept). Sort-free: draw, and if the token falls outside
    the nucleus, drop it and every token no more probable, then draw again. All tokens of the
    nucleus survive each drop, and the result follows the renormalised nucleus distribution exactly.
    Draws repeat only for rows with top_p < 1, usually once or twice.
    """
    total = weights.sum(dim=-1)  # [R]
    if not bool(torch.isfinite(total).all()):
        raise ValueError(
            "a sampled row has NaN or infinite logits, or none left finite: the model produced "
            "invalid values, or penalties and min_tokens masked every token"
        )
    token_ids = _inverse_cdf(weights, rng.uniforms(list(range(len(top_p))), draw_round=0))
    rows = [i for i, p in enumerate(top_p) if p < 1.0]  # rows still looking for a nucleus token
    if not rows:
        return token_ids
    row_index = torch.tensor(rows, device=weights.device)
    weights = weights[row_index]  # [A, V]
    nucleus_mass = torch.tensor([top_p[i] for i in rows], device=weights.device) * total[row_index]
    candidate = token_ids[row_index]  # [A]
    draw_round = 0
    while True:
        chosen = weights.gather(1, candidate[:, None])  # [A, 1]
        mass_above = torch.where(weights > chosen, weights, 0.0).sum(dim=-1)  # [A]
        # The most probable tokens are always in the nucleus, even when top_p rounds to 0 in float32.
        rejected = ((mass_above >= nucleus_mass) & (mass_above > 0)).nonzero().squeeze(1)
        token_ids[row_index] = candidate
        if rejected.numel() == 0:
            return token_ids
        draw_round += 1
        row_index, nucleus_mass = row_index[rejected], nucleus_mass[rejected]
        weights = weights[rejected]  # [A', V]: drop the rejected token and all no more probable
        weights.masked_fill_(weights <= chosen[rejected], 0.0)
        rows = [rows[i] for i in rejected.tolist()]
        candidate = _inverse_cdf(weights, rng.uniforms(rows, draw_round))


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Weights [R, V] >= 0 with a positive sum, uniforms [R] float64 in [0, 1) -> token ids [R].

    Row i returns the first token whose cumulative weight exceeds uniforms[i] * total weight, so a
    token of zero weight is never returned. Two levels avoid a float64 cumulative sum over the
    whole vocabulary: pick the block of _CDF_BLOCK tokens, then the token inside it.
    """
    num_rows, vocab_size = weights.shape
    num_blocks = -(-vocab_size // _CDF_BLOCK)
    num_padding = num_blocks * _CDF_BLOCK - vocab_size
    padded = F.pad(weights, (0, num_padding)) if num_padding else weights  # zero weight past V
    blocks = padded.view(num_rows, num_blocks, _CDF_BLOCK)  # [R, num_blocks, B]
    # Block sums in float32 (a float64 sum would convert the whole vocabulary first).
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [R, num_blocks]
    target = _below(uniforms[:, None] * block_cdf[:, -1:], block_cdf[:, -1:])  # [R, 1]
    block = torch.searchsorted(block_cdf, target, right=True)  # [R, 1]
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)  # [R, 1]
    inside = blocks.gather(1, block[:, :, None].expand(-1, 1, _CDF_BLOCK)).squeeze(1)  # [R, B]
    inside_cdf = inside.cumsum(dim=-1, dtype=torch.float64)  # [R, B]
    offset = torch.searchsorted(inside_cdf, _below(target - before, inside_cdf[:, -1:]), right=True)
    return (block * _CDF_BLOCK + offset).squeeze(1)  # [R]


def _below(values: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Values clamped to just under totals, so searching for them lands on a weighted token."""
    return torch.minimum(values, torch.nextafter(totals, torch.zeros_like(totals)))


class RowRandom:
    """Uniforms in [0, 1) for the rows of a batch, one per row per draw round.

    Unseeded rows use the global torch RNG. A seeded row's number depends on (seed,
    num_output_tokens, draw round) only, so it is the same in every batch, process and machine.
    """

    def __init__(self, requests: Sequence[Request], device: torch.device):
        self._requests = requests
        self._device = device

    def uniforms(self, rows: list[int], draw_round: int) -> torch.Tensor:  # [len(rows)] float64
        uniforms = torch.rand(len(rows), dtype=torch.float64)
        for j, i in enumerate(rows):
            request = self._requests[i]
            if request.sampling_params.seed is not None:
                seed = request.sampling_params.seed
                uniforms[j] = seeded_uniform(seed, request.num_output_tokens, draw_round)
        return uniforms.to(self._device)


def seeded_uniform(seed: int, step: int, draw_round: int = 0) -> float:
    """A uniform in [0, 1) that depends on its arguments only: the same in every process."""
    mixed = _mix64(seed & _UINT64)
    for value in (step, draw_round):
        mixed = _mix64((mixed + value) & _UINT64)
    return (mixed >> 11) * 2.0**-53


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit integers that scrambles every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & _UINT64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _UINT64
    return value ^ (value >> 31)


# --------------------------------------------------------------------------- logprobs


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[Request]
) -> list[dict[int, float] | None]:
    """Raw logits [num_seqs, V], chosen ids [num_seqs] -> per row {chosen and top-N id: logprob}."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not rows:
        return [None] * len(requests)
    row_index = torch.tensor(rows, device=logits.device)
    picked = logits if len(rows) == len(requests) else logits[row_index]  # [R, V]
    logprobs = _finite_logprobs(picked)  # [R, V]
    chosen = token_ids[row_index][:, None]  # [R, 1]
    num_top = min(max(requests[i].sampling_params.logprobs for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [R, N], descending
    # One float64 table, one transfer: [chosen id, its logprob, top ids..., top logprobs...].
    columns = [chosen, logprobs.gather(1, chosen), top_ids, top_values]
    table = torch.cat([column.to(torch.float64) for column in columns], dim=-1)  # [R, 2 + 2N]
    result: list[dict[int, float] | None] = [None] * len(requests)
    for row, values in zip(rows, table.tolist()):
        num_wanted = min(requests[row].sampling_params.logprobs, num_top)
        entry = {int(values[0]): values[1]}
        for j in range(num_wanted):
            entry[int(values[2 + j])] = values[2 + num_top + j]
        result[row] = entry
    return result


def _finite_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probs [R, V] of raw logits [R, V]; impossible tokens (and NaN logits) get the lowest
    float32 instead of -inf, so every reported value is finite."""
    logits = torch.nan_to_num(logits.float(), nan=-math.inf, posinf=_FLOAT32_MAX)
    return torch.log_softmax(logits, dim=-1).nan_to_num_(nan=-_FLOAT32_MAX, neginf=-_FLOAT32_MAX)
