"""The trace dataset of `pdserve bench`: each bad line refused with its number and the fix; prompts as text,
token ids or random tokens; phase windows from the labels; and --save-trace of a phased schedule read back as
the same schedule."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.serve_datasets import DatasetError
from pdserve.bench.serve_schedule import phased_schedule, trace_schedule
from pdserve.bench.serve_trace import read_trace, trace_samples, trace_windows, write_trace
from pdserve.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return load_tokenizer(model_factory("llama"))


def write_lines(path, *lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


GOOD = {"arrival_s": 0.5, "prompt": "hello there", "output_len": 4}


@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", r"line 2: not valid JSON \(.*\): write one object per line, e.g. \{\"arrival_s\""),
    ("[1, 2]", r"line 2: a JSON list, not an object: write one object per line"),
    ({"prompt": "x", "output_len": 4}, r"line 2: \"arrival_s\" None is not a number of seconds >= 0: give each line "
                                       r"its arrival offset"),
    ({"arrival_s": -1, "prompt": "x", "output_len": 4}, r"line 2: \"arrival_s\" -1 is not a number of seconds"),
    ({"arrival_s": 0.2, "prompt": "x", "output_len": 4}, r"line 2: \"arrival_s\" 0.2 comes before the line above "
                                                         r"\(0.5\): sort the lines by arrival_s"),
    ({"arrival_s": 1, "output_len": 4}, r"line 2: no prompt: give \"prompt\" \(text\), \"prompt_token_ids\" or "
                                        r"\"input_len\""),
    ({"arrival_s": 1, "prompt": "x", "input_len": 5, "output_len": 4}, r"line 2: \"input_len\" with a prompt"),
    ({"arrival_s": 1, "prompt_token_ids": [1, -2], "output_len": 4}, r"line 2: \"prompt_token_ids\" is not a "
                                                                     r"non-empty list of token ids >= 0"),
    ({"arrival_s": 1, "input_len": 0, "output_len": 4}, r"line 2: \"input_len\" 0 is not a whole number"),
    ({"arrival_s": 1, "prompt": "x"}, r"line 2: \"output_len\" None is not a whole number of tokens >= 1: give each "
                                      r"line its output_len \(or pass --output-len\)"),
    ({"arrival_s": 1, "prompt": "x", "output_len": 4, "outputlen": 3}, r"line 2: unknown field 'outputlen': use only "
                                                                       r"arrival_s, prompt"),
    ({"arrival_s": 1, "prompt": "x", "output_len": 4, "cycle": 2}, r"line 2: \"cycle\" 2 needs a \"phase\""),
    ({"arrival_s": 1, "prompt": "x", "output_len": 4, "phase": 1}, r"line 2: \"phase\" is on some lines and not "
                                                                    r"on others"),
])
def test_a_bad_line_is_refused_with_its_number_and_the_fix(tmp_path, bad, message):
    path = write_lines(tmp_path / "t.jsonl", GOOD, bad)
    with pytest.raises(DatasetError, match=rf"^{tmp_path}/t.jsonl: {message}"):
        read_trace(path)


def test_an_empty_trace_and_a_missing_file_are_refused(tmp_path):
    with pytest.raises(DatasetError, match="no requests in it"):
        read_trace(write_lines(tmp_path / "t.jsonl", ""))
    with pytest.raises(DatasetError, match="no such file"):
        read_trace(tmp_path / "none.jsonl")


def test_prompts_as_text_ids_or_random_tokens(tmp_path, tokenizer):
    path = write_lines(tmp_path / "t.jsonl",
                       {"arrival_s": 0, "prompt": "hello there", "output_len": 3},
                       {"arrival_s": 0.5, "prompt_token_ids": [300, 301, 302], "output_len": 4},
                       {"arrival_s": 0.5, "input_len": 17},
                       "")
    lines = read_trace(path, default_output_len=9)
    samples = trace_samples(lines, tokenizer, seed=1, path=path)
    assert [line.arrival_s for line in lines] == [0.0, 0.5, 0.5]
    assert samples[0].prompt == "hello there" and samples[0].prompt_token_ids is None and samples[0].output_len == 3
    assert samples[1].prompt_token_ids == (300, 301, 302) and samples[1].prompt_len == 3
    assert samples[1].prompt == tokenizer.decode([300, 301, 302])
    assert samples[2].prompt_len == 17 and samples[2].output_len == 9  # --output-len for a line without one
    assert samples == trace_samples(lines, tokenizer, seed=1, path=path)
    assert samples[2] != trace_samples(lines, tokenizer, seed=2, path=path)[2]
    with pytest.raises(DatasetError, match="need a tokenizer: pass --tokenizer"):
        trace_samples(lines, None, seed=1, path=path)


def test_windows_are_runs_of_the_same_phase_and_cycle(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", *[
        {"arrival_s": t, "prompt": "x", "output_len": 2, "phase": phase, "cycle": cycle}
        for t, phase, cycle in [(0.1, 1, 1), (0.4, 1, 1), (1.0, "long", 1), (2.5, 1, 2), (3.0, 1, 2)]])
    windows, owners = trace_windows(read_trace(path))
    assert [(w.name, w.start_s, w.end_s) for w in windows] == [
        ("phase 1 cycle 1", 0.1, 1.0), ("phase long cycle 1", 1.0, 2.5), ("phase 1 cycle 2", 2.5, 3.0)]
    assert owners == [0, 0, 1, 2, 2]
    unlabelled = write_lines(tmp_path / "u.jsonl", GOOD)
    assert trace_windows(read_trace(unlabelled)) == ([], None)


def test_a_saved_phased_schedule_replays_as_the_same_schedule(tmp_path, tokenizer):
    args = argparse.Namespace(phases="30:5:4:3,6:9:12:2:0.5", phase_cycles=2, burstiness=0.7, seed=9, warmup=1,
                              dataset_path=str(tmp_path / "trace.jsonl"), output_len=None)
    phased = phased_schedule(args, tokenizer)
    write_trace(args.dataset_path, phased.samples, phased.offsets, phased.windows, phased.owners)
    replay = trace_schedule(args, tokenizer)
    assert replay.offsets == phased.offsets  # exactly: JSON keeps every bit of a float
    assert replay.samples == phased.samples  # the same token ids, text, lengths
    assert replay.owners == phased.owners
    assert [w.name for w in replay.windows] == [w.name for w in phased.windows]
    assert [w.start_s for w in replay.windows] == [phased.offsets[phased.owners.index(i)] for i in range(4)]
    assert replay.warmup == phased.samples[:1]


def test_a_saved_random_schedule_replays_without_phases(tmp_path, tokenizer):
    from pdserve.bench.serve_arrivals import arrival_offsets
    from pdserve.bench.serve_datasets import random_dataset

    samples = random_dataset(tokenizer, 6, 12, 3, 0.3, seed=5)
    offsets = arrival_offsets(6, 4.0, 1.0, seed=5).tolist()
    path = write_trace(tmp_path / "random.jsonl", samples, offsets)
    assert all("phase" not in json.loads(line) for line in path.read_text().splitlines())
    replay = trace_schedule(argparse.Namespace(dataset_path=str(path), output_len=None, seed=0, warmup=0), tokenizer)
    assert (replay.samples, replay.offsets, replay.windows, replay.owners) == (samples, offsets, [], None)
