"""The prompts of a benchmark run: random (exact token counts), ShareGPT, shared-prefix groups, JSONL.

Each loader returns SampleRequests; a bad input file is a DatasetError that names the file, the line or
entry, and the fix. Random and prefix prompts are token ids (sent as ids where the server takes them)
with their decoded text, which re-encodes to the same number of tokens where the tokenizer allows it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ShareGPT conversations outside these bounds are skipped, as vLLM's loader does.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
EXACT_LEN_TRIES = 10
MAX_TOKEN_POOL = 20000


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class SampleRequest:
    prompt: str  # the text (the chat endpoint, and servers that take no token ids)
    prompt_len: int | None  # tokens by the tokenizer; None without one
    output_len: int  # max_tokens asked
    prompt_token_ids: tuple[int, ...] | None = None  # the exact prompt, for servers that take token ids


def length_range(length: int, range_ratio: float, option: str) -> tuple[int, int]:
    """[low, high] of lengths drawn uniformly around `length` (vLLM's --random-range-ratio)."""
    if length < 1:
        raise ValueError(f"{option} {length} must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio {range_ratio} must be in [0, 1): lengths are drawn from "
                         "[len * (1 - ratio), len * (1 + ratio)]")
    return max(1, int(np.floor(length * (1 - range_ratio)))), int(np.ceil(length * (1 + range_ratio)))


def draw_lengths(rng: np.random.Generator, num: int, length: int, range_ratio: float, option: str) -> list[int]:
    low, high = length_range(length, range_ratio, option)
    return rng.integers(low, high + 1, size=num).tolist()


def plain_token_ids(tokenizer) -> np.ndarray:
    """The ids random prompts are drawn from: no special tokens, and only tokens that come back as
    themselves when decoded and encoded alone (not a byte of a character), so prompts re-encode exactly."""
    special = set(tokenizer.all_special_ids)
    candidates = [i for i in range(tokenizer.vocab_size) if i not in special]
    if len(candidates) > MAX_TOKEN_POOL:  # checking a sample is enough, and fast for 100k+ vocabularies
        candidates = sorted(np.random.default_rng(0).choice(candidates, MAX_TOKEN_POOL, replace=False).tolist())
    texts = tokenizer.batch_decode([[i] for i in candidates])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    plain = [i for i, text, ids in zip(candidates, texts, encoded) if ids == [i] and "\ufffd" not in text]
    if not plain:
        raise DatasetError("the tokenizer has no token that decodes and encodes back to itself: pass another "
                           "--tokenizer, or --dataset jsonl")
    return np.array(plain)


def exact_prompt(tokenizer, token_ids: list[int], pool: np.ndarray, rng: np.random.Generator) -> tuple[str, list[int]]:
    """(text, ids) of len(token_ids) tokens whose text re-encodes to those ids: decoding and re-encoding
    can merge or split tokens, so the ids are trimmed or topped up until they agree (a few tries)."""
    target = len(token_ids)
    ids = list(token_ids)
    for _ in range(EXACT_LEN_TRIES):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == target:
            return text, again
        ids = again[:target] + rng.choice(pool, size=max(0, target - len(again))).tolist()
    return tokenizer.decode(ids), ids  # the ids are exact; the text may re-encode a token or two off


def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> list[SampleRequest]:
    """Prompts of random tokens, exact in length, drawn around --input-len / --output-len."""
    rng = np.random.default_rng(seed)
    pool = plain_token_ids(tokenizer)
    input_lens = draw_lengths(rng, num_prompts, input_len, range_ratio, "--input-len")
    output_lens = draw_lengths(rng, num_prompts, output_len, range_ratio, "--output-len")
    return random_prompts(tokenizer, pool, rng, input_lens, output_lens)


def random_prompts(tokenizer, pool: np.ndarray, rng: np.random.Generator, input_lens: list[int],
                   output_lens: list[int]) -> list[SampleRequest]:
    """One prompt of random tokens from `pool` per (input, output) length, exact in length."""
    samples = []
    for prompt_len, max_tokens in zip(input_lens, output_lens):
        text, ids = exact_prompt(tokenizer, rng.choice(pool, size=prompt_len).tolist(), pool, rng)
        samples.append(SampleRequest(text, len(ids), max_tokens, tuple(ids)))
    return samples


def prefix_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   prefix_len: int, num_prefix_groups: int, seed: int) -> list[SampleRequest]:
    """Groups of prompts that share their first --prefix-len tokens (exercising prefix caches); each
    prompt is --input-len tokens in all (around it with --range-ratio), the rest random."""
    if num_prefix_groups < 1:
        raise ValueError(f"--num-prefix-groups {num_prefix_groups} must be at least 1")
    low, _ = length_range(input_len, range_ratio, "--input-len")
    if not 0 < prefix_len < low:
        raise ValueError(f"--prefix-len {prefix_len} must be above 0 and below the shortest prompt ({low} tokens "
                         "from --input-len and --range-ratio): each prompt needs tokens of its own after the prefix")
    rng = np.random.default_rng(seed)
    pool = plain_token_ids(tokenizer)
    prefixes = [exact_prompt(tokenizer, rng.choice(pool, size=prefix_len).tolist(), pool, rng)[1]
                for _ in range(num_prefix_groups)]
    input_lens = draw_lengths(rng, num_prompts, input_len, range_ratio, "--input-len")
    output_lens = draw_lengths(rng, num_prompts, output_len, range_ratio, "--output-len")
    groups = rng.permutation(np.arange(num_prompts) % num_prefix_groups)
    samples = []
    for group, prompt_len, max_tokens in zip(groups, input_lens, output_lens):
        suffix = rng.choice(pool, size=prompt_len - prefix_len).tolist()
        ids = prefixes[group] + suffix
        samples.append(SampleRequest(tokenizer.decode(ids), len(ids), max_tokens, tuple(ids)))
    return samples


def read_text(path: str | Path, what: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"{path}: no such file: pass --dataset-path a {what} file")
    try:
        return file.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no JSON error
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read it as UTF-8 text ({exc}): pass a {what} file") from exc


def _turn_text(turn: Any, path: str | Path, index: int) -> str:
    text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
    if not isinstance(text, str):
        raise DatasetError(f'{path}: entry {index}: a turn of "conversations" is not {{"from": ..., "value": "text"}} '
                           "(or {\"role\": ..., \"content\": \"text\"}): fix the entry or remove it")
    return text


def _sharegpt_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) of each conversation with at least two turns."""
    text = read_text(path, "ShareGPT JSON")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg}): a ShareGPT "
                           'file is one JSON list of {"conversations": [{"from": "human", "value": "..."}, ...]}') from exc
    if not isinstance(data, list):
        raise DatasetError(f'{path}: the top level is a {type(data).__name__}, not a list: a ShareGPT file is one '
                           'JSON list of {"conversations": [...]} entries')
    pairs = []
    for index, entry in enumerate(data):
        turns = entry.get("conversations", entry.get("conversation")) if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(f'{path}: entry {index} has no "conversations" list: each entry needs '
                               '{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}')
        if len(turns) >= 2:
            pairs.append((_turn_text(turns[0], path, index), _turn_text(turns[1], path, index)))
    return pairs


def sharegpt_dataset(path: str | Path, tokenizer, num_prompts: int, output_len: int | None,
                     seed: int) -> list[SampleRequest]:
    """ShareGPT conversations in a seeded random order: the first turn is the prompt, and the reply's
    length in tokens the output length (unless --output-len is given)."""
    pairs = _sharegpt_pairs(path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    samples: list[SampleRequest] = []
    for index in order:
        prompt, reply = pairs[index]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        reply_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        samples.append(SampleRequest(prompt, prompt_len, reply_len))
        if len(samples) == num_prompts:
            break
    if not samples:
        raise DatasetError(f"{path}: no conversation has two turns of {SHAREGPT_MIN_LEN} to {SHAREGPT_MAX_PROMPT_LEN} "
                           "prompt tokens: pass a ShareGPT file with real conversations")
    return samples


def _jsonl_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    for line_number, line in enumerate(read_text(path, "JSONL").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f'{path}: line {line_number}: not valid JSON ({exc.msg}): write one object per line, '
                               'e.g. {"prompt": "Hello", "output_len": 64}') from exc
        if not isinstance(record, dict):
            raise DatasetError(f'{path}: line {line_number}: a {type(record).__name__}, not an object: write '
                               '{"prompt": "...", "output_len": N} on each line')
        yield line_number, record


def jsonl_dataset(path: str | Path, tokenizer, num_prompts: int,
                  default_output_len: int | None = None) -> list[SampleRequest]:
    """One request per line, `{"prompt": "text", "output_len": N}`, in file order; a line without its
    output_len takes `default_output_len` (--output-len; vLLM's custom files carry prompts only)."""
    samples = []
    for line_number, record in _jsonl_records(path):
        prompt = record.get("prompt")
        output_len = record.get("output_len", default_output_len)
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f'{path}: line {line_number}: "prompt" must be a non-empty string: '
                               'write {"prompt": "text", "output_len": N}')
        if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
            raise DatasetError(f'{path}: line {line_number}: "output_len" must be a whole number of tokens, at least '
                               f'1 (got {output_len!r}): write {{"prompt": "text", "output_len": N}}')
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else None
        samples.append(SampleRequest(prompt, prompt_len, output_len))
        if len(samples) == num_prompts:
            break
    if not samples:
        raise DatasetError(f'{path}: no requests in it: write one {{"prompt": "text", "output_len": N}} per line')
    return samples


def repeat_to(samples: list[SampleRequest], num_prompts: int) -> list[SampleRequest]:
    """The samples cycled to num_prompts (a file with fewer requests than asked is sent again from its start)."""
    return [samples[i % len(samples)] for i in range(num_prompts)]
