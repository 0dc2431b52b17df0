"""`pdserve bench` datasets on small files and the tiny model's tokenizer: lengths, groups, seeds, and the
errors a bad file gets (file, line or entry, and the fix)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serve_datasets import (
    DatasetError,
    jsonl_dataset,
    prefix_dataset,
    random_dataset,
    repeat_to,
    sharegpt_dataset,
)
from pdserve.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return load_tokenizer(model_factory("llama"))


def count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_are_exact_in_tokens_and_follow_the_seed(tokenizer):
    samples = random_dataset(tokenizer, 12, input_len=40, output_len=7, range_ratio=0.0, seed=3)
    assert [s.prompt_len for s in samples] == [40] * 12 and [s.output_len for s in samples] == [7] * 12
    assert all(len(s.prompt_token_ids) == 40 for s in samples)
    assert all(count(tokenizer, s.prompt) == 40 for s in samples)  # the text says the same number of tokens
    assert set(tokenizer.all_special_ids).isdisjoint(i for s in samples for i in s.prompt_token_ids)
    assert samples == random_dataset(tokenizer, 12, 40, 7, 0.0, seed=3)
    assert samples != random_dataset(tokenizer, 12, 40, 7, 0.0, seed=4)


def test_random_lengths_spread_over_the_range_ratio(tokenizer):
    samples = random_dataset(tokenizer, 60, input_len=20, output_len=10, range_ratio=0.5, seed=0)
    input_lens = {s.prompt_len for s in samples}
    assert min(input_lens) >= 10 and max(input_lens) <= 30 and len(input_lens) > 5
    assert all(5 <= s.output_len <= 15 for s in samples)
    with pytest.raises(ValueError, match="--range-ratio"):
        random_dataset(tokenizer, 2, 20, 10, range_ratio=1.0, seed=0)


def test_prefix_groups_share_their_first_tokens(tokenizer):
    samples = prefix_dataset(tokenizer, 12, input_len=30, output_len=5, range_ratio=0.0, prefix_len=16,
                             num_prefix_groups=3, seed=0)
    assert all(len(s.prompt_token_ids) == 30 == s.prompt_len for s in samples)
    prefixes = [s.prompt_token_ids[:16] for s in samples]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({s.prompt_token_ids[16:] for s in samples}) == 12  # the rest is each prompt's own
    with pytest.raises(ValueError, match="--prefix-len 30"):
        prefix_dataset(tokenizer, 4, 30, 5, 0.0, prefix_len=30, num_prefix_groups=2, seed=0)


def write_sharegpt(path, entries) -> str:
    path.write_text(json.dumps(entries))
    return str(path)


def conversation(*turns: str) -> dict:
    return {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]}


LONG_PROMPT = "Tell me how a paged KV cache keeps the memory of many requests apart"
LONG_REPLY = "Each request owns a list of fixed size blocks and a table maps its positions onto them"


def test_sharegpt_takes_the_first_turn_and_the_length_of_the_reply(tokenizer, tmp_path):
    path = write_sharegpt(tmp_path / "chats.json", [
        conversation(LONG_PROMPT, LONG_REPLY, "and then?"),
        conversation("only one turn"),  # skipped: no reply
        conversation("hi", "hello"),  # skipped: under 4 tokens
        {"conversations": [{"role": "user", "content": LONG_REPLY}, {"role": "assistant", "content": LONG_PROMPT}]},
    ])
    samples = sharegpt_dataset(path, tokenizer, 10, output_len=None, seed=0)
    assert sorted(s.prompt for s in samples) == sorted([LONG_PROMPT, LONG_REPLY])
    by_prompt = {s.prompt: s for s in samples}
    assert by_prompt[LONG_PROMPT].output_len == count(tokenizer, LONG_REPLY)
    assert by_prompt[LONG_PROMPT].prompt_len == count(tokenizer, LONG_PROMPT)
    assert [s.output_len for s in sharegpt_dataset(path, tokenizer, 10, output_len=9, seed=0)] == [9, 9]
    assert len(sharegpt_dataset(path, tokenizer, 1, output_len=None, seed=0)) == 1


@pytest.mark.parametrize(("content", "message"), [
    ('[{"conversations": [\n  {"from": "human", "value": "x"},,\n]}]', r"line 2 column .*not valid JSON"),
    ('{"conversations": []}', "top level is a dict, not a list"),
    ('[{"conversations": []}, {"messages": []}]', 'entry 1 has no "conversations" list'),
    ('[{"conversations": [{"from": "human"}, {"from": "gpt", "value": "y"}]}]', 'entry 0: a turn of "conversations"'),
    ('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]', "no conversation"),
])
def test_bad_sharegpt_files_name_the_file_the_place_and_the_fix(tokenizer, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message) as error:
        sharegpt_dataset(path, tokenizer, 4, None, seed=0)
    assert str(path) in str(error.value)
    with pytest.raises(DatasetError, match="no such file"):
        sharegpt_dataset(tmp_path / "missing.json", tokenizer, 4, None, seed=0)


def test_jsonl_sends_each_line_with_its_output_length(tokenizer, tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 5}\n\n{"prompt": "Bye", "output_len": 2, "x": 1}\n')
    samples = jsonl_dataset(path, tokenizer, 10)
    assert [(s.prompt, s.output_len) for s in samples] == [("Hello there", 5), ("Bye", 2)]
    assert samples[0].prompt_len == count(tokenizer, "Hello there")
    assert jsonl_dataset(path, None, 10)[0].prompt_len is None  # no tokenizer: the server's usage counts
    assert [s.prompt for s in repeat_to(samples, 5)] == ["Hello there", "Bye", "Hello there", "Bye", "Hello there"]


@pytest.mark.parametrize(("second_line", "message"), [
    ('{"prompt": "x", "output_len": 4', "line 2: not valid JSON"),
    ('["x", 4]', "line 2: a list, not an object"),
    ('{"text": "x", "output_len": 4}', 'line 2: "prompt" must be a non-empty string'),
    ('{"prompt": "x", "output_len": 0}', 'line 2: "output_len" must be a whole number'),
    ('{"prompt": "x", "output_len": "4"}', 'line 2: "output_len" must be a whole number'),
    ('{"prompt": "x", "output_len": true}', 'line 2: "output_len" must be a whole number'),
])
def test_bad_jsonl_lines_are_named_with_the_fix(tmp_path, second_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "output_len": 3}\n' + second_line + "\n")
    with pytest.raises(DatasetError, match=message) as error:
        jsonl_dataset(path, None, 10)
    assert str(error.value).startswith(str(path)) and '{"prompt"' in str(error.value)


def test_an_empty_jsonl_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DatasetError, match="no requests in it"):
        jsonl_dataset(path, None, 3)


def test_a_file_with_a_byte_order_mark_reads_like_one_without(tokenizer, tmp_path):
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_text('{"prompt": "Hello there", "output_len": 5}\n', encoding="utf-8-sig")  # as Windows editors save
    assert [(s.prompt, s.output_len) for s in jsonl_dataset(jsonl, None, 1)] == [("Hello there", 5)]
    sharegpt = tmp_path / "bom.json"
    turns = [{"from": "human", "value": "Tell me a story about a dragon"}, {"from": "gpt", "value": "Once upon a time"}]
    sharegpt.write_text(json.dumps([{"conversations": turns}]), encoding="utf-8-sig")
    assert sharegpt_dataset(sharegpt, tokenizer, 1, None, seed=0)[0].prompt == "Tell me a story about a dragon"
