"""Response shapes of prompt logprobs (router/responses.py), fed ChoiceDeltas as the choice runner makes them:
completions' echo with logprobs (whole and streamed), vLLM's prompt_logprobs field (per choice on completions,
top-level on chat), and nothing added to answers that did not ask."""

from __future__ import annotations

import pytest

from pdserve.router.generation import ChoiceDelta
from pdserve.router.responses import ChatFormatter, CompletionFormatter, Prompt

TEXT = "def main(): return 1"


@pytest.fixture
def prompt(tokenization) -> Prompt:
    return Prompt(TEXT, tokenization.tokenizer.encode(TEXT))


def rows_for(token_ids: list[int]) -> list:
    """Engine-shaped prompt logprobs: at position p the prompt token (rank p % 3 + 1) and three others of
    ranks 1..3 (the prompt token among them where its rank says so)."""
    rows = [None]
    for position, token_id in enumerate(token_ids[1:], start=1):
        rank = position % 3 + 1
        entry = {token_id: (-0.5 * rank, rank)}
        for column, other in enumerate((11, 12, 13), start=1):
            entry.setdefault(token_id if column == rank else other, (-0.5 * column, column))
        rows.append(entry)
    return rows


def completions(tokenization, prompt, **options) -> CompletionFormatter:
    settings = {"num_logprobs": None, "return_token_ids": False, "include_usage": False, **options}
    return CompletionFormatter("r", "tiny", tokenization, [prompt], settings.pop("n", 1), **settings)


def deltas(prompt: Prompt, generated=(21, 22, 23), index: int = 0) -> list[ChoiceDelta]:
    first, *rest = generated
    return [ChoiceDelta(index, "A", [first], [{first: -0.1, 99: -2.0}], prompt_logprobs=rows_for(prompt.token_ids)),
            *[ChoiceDelta(index, "B", [t], [{t: -0.2, 98: -3.0}]) for t in rest[:-1]],
            ChoiceDelta(index, "C", [rest[-1]], [{rest[-1]: -0.3}], finish_reason="length")]


def assert_continuous(logprobs: dict) -> None:
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert offsets[0] == 0
    assert all(offsets[i + 1] == offsets[i] + len(tokens[i]) for i in range(len(tokens) - 1)), offsets


def test_echo_with_logprobs_puts_the_prompt_before_the_generated_tokens(tokenization, prompt):
    formatter = completions(tokenization, prompt, num_logprobs=1, echo=True)
    for delta in deltas(prompt):
        formatter.totals[0].add(delta)
    choice = formatter.body()["choices"][0]
    assert choice["text"] == TEXT + "ABC"
    logprobs = choice["logprobs"]
    num_prompt = len(prompt.token_ids)
    assert logprobs["tokens"] == [tokenization.token_text(t) for t in prompt.token_ids + [21, 22, 23]]
    rows = rows_for(prompt.token_ids)
    assert logprobs["token_logprobs"][:num_prompt] == [None] + [rows[p][t][0] for p, t in
                                                               enumerate(prompt.token_ids[1:], start=1)]
    assert logprobs["token_logprobs"][num_prompt:] == [-0.1, -0.2, -0.3]
    top = logprobs["top_logprobs"]
    assert top[0] is None and len(top) == num_prompt + 3
    for position in range(1, num_prompt):
        token_id = prompt.token_ids[position]
        likeliest = next(k for k, (_, rank) in rows[position].items() if rank == 1)
        expected = {tokenization.token_text(token_id): rows[position][token_id][0],
                    tokenization.token_text(likeliest): -0.5}
        assert top[position] == expected, position  # the prompt token and the top 1, keyed by token string
    assert top[num_prompt] == {tokenization.token_text(21): -0.1}
    assert_continuous(logprobs)
    assert "prompt_logprobs" not in choice, "not asked for"
    assert formatter.usage()["completion_tokens"] == 3 and formatter.usage()["prompt_tokens"] == num_prompt


def test_an_echoed_token_prompt_keeps_its_special_tokens_so_the_offsets_point_into_the_text(tokenization):
    """A token-id prompt is echoed as the tokenizer decodes it with its special tokens (as vLLM echoes it),
    so each prompt token's text_offset points at that token's text in the echoed text. Skipping them (the
    earlier echo) made the offsets run past it."""
    special = tokenization.tokenizer.all_special_ids[0]
    ids = tokenization.tokenizer.encode(TEXT)
    prompt = Prompt(None, [special, *ids[:3], special, *ids[3:]])
    formatter = completions(tokenization, prompt, num_logprobs=0, echo=True)
    for delta in deltas(prompt):
        formatter.totals[0].add(delta)
    choice = formatter.body()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert tokenization.token_text(special) in text
    for token, offset in zip(logprobs["tokens"][:len(prompt.token_ids)], logprobs["text_offset"]):
        assert text[offset:offset + len(token)] == token, (token, offset, text)
    assert text.endswith("ABC")


def test_a_streamed_echo_carries_the_prompt_in_each_choices_first_chunk(tokenization, prompt):
    whole = completions(tokenization, prompt, num_logprobs=1, echo=True, n=2)
    streamed = completions(tokenization, prompt, num_logprobs=1, echo=True, n=2)
    chunks = {0: [], 1: []}
    for first, second in zip(deltas(prompt), deltas(prompt, index=1)):
        for delta in (first, second):
            whole.totals[delta.index].add(delta)
            chunks[delta.index].append(streamed.chunk(delta)["choices"][0])
    for index in (0, 1):
        head, *tail = chunks[index]
        assert head["text"] == TEXT + "A" and all(not c["text"].startswith(TEXT) for c in tail)
        assert len(head["logprobs"]["tokens"]) == len(prompt.token_ids) + 1
        joined = {key: [v for c in chunks[index] for v in c["logprobs"][key]] for key in head["logprobs"]}
        assert joined == whole.body()["choices"][index]["logprobs"], "streamed and whole agree"
        assert_continuous(joined)


def test_echo_without_generation_is_the_prompt_alone(tokenization, prompt):
    formatter = completions(tokenization, prompt, num_logprobs=0, echo=True)
    only = ChoiceDelta(0, "", [], [], "length", prompt_logprobs=rows_for(prompt.token_ids))
    chunk = formatter.chunk(only)["choices"][0]
    assert chunk["text"] == TEXT and chunk["finish_reason"] == "length"
    assert chunk["logprobs"]["tokens"] == [tokenization.token_text(t) for t in prompt.token_ids]
    assert [len(t) if t else t for t in chunk["logprobs"]["top_logprobs"]] == [None] + [1] * (len(prompt.token_ids) - 1)
    body = formatter.body()
    assert body["choices"][0]["logprobs"] == chunk["logprobs"]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt.token_ids)


def check_vllm_shape(field: list, prompt: Prompt, tokenization, num: int) -> None:
    rows = rows_for(prompt.token_ids)
    assert field[0] is None and len(field) == len(prompt.token_ids)
    for position, entry in enumerate(field[1:], start=1):
        token_id = prompt.token_ids[position]
        own_rank = rows[position][token_id][1]
        assert next(iter(entry)) == str(token_id), "the prompt token first"
        assert entry[str(token_id)] == {"logprob": rows[position][token_id][0], "rank": own_rank,
                                        "decoded_token": tokenization.token_text(token_id)}
        assert sorted(v["rank"] for k, v in entry.items() if k != str(token_id) or own_rank <= num) == \
            list(range(1, num + 1)), entry


@pytest.mark.parametrize("num", [0, 2, 3])
def test_completions_report_prompt_logprobs_per_choice(tokenization, prompt, num):
    formatter = completions(tokenization, prompt, num_prompt_logprobs=num)
    for delta in deltas(prompt):
        formatter.totals[0].add(delta)
    choice = formatter.body()["choices"][0]
    check_vllm_shape(choice["prompt_logprobs"], prompt, tokenization, num)
    assert choice["logprobs"] is None and choice["text"] == "ABC"


def test_chat_reports_prompt_logprobs_at_the_top_level(tokenization, prompt):
    def chat(**options):
        formatter = ChatFormatter("r", "tiny", tokenization, [prompt], 2, num_logprobs=None, return_token_ids=False,
                                  include_usage=False, **options)
        for index in (0, 1):
            for delta in deltas(prompt, index=index):
                formatter.totals[index].add(delta)
        return formatter.body()
    body = chat(num_prompt_logprobs=2)
    check_vllm_shape(body["prompt_logprobs"], prompt, tokenization, 2)
    assert all("prompt_logprobs" not in choice for choice in body["choices"])
    assert "prompt_logprobs" not in chat(), "not asked for: the key is left out"
