"""Prompt logprobs on the wire: tables cut into bounded PromptLogprobs messages, read back exactly, and
gathered in order into vLLM's [None, position 1, ...] shape."""

import pytest
import torch

from pdserve.control.errors import ProtocolError
from pdserve.control.messages import MAX_PROMPT_LOGPROB_ENTRIES, PromptLogprobs
from pdserve.control.prompt_logprobs import PromptLogprobsAssembler, pack, read
from pdserve.control.protocol import decode, encode


def tables(num_positions: int, width: int):
    generator = torch.Generator().manual_seed(num_positions * 31 + width)
    ids = torch.randint(0, 50_000, (num_positions, width), generator=generator, dtype=torch.int32)
    logprobs = -torch.rand(num_positions, width, generator=generator) * 10
    ranks = torch.randint(1, 50_000, (num_positions,), generator=generator, dtype=torch.int32)
    return ids, logprobs, ranks


def over_the_wire(messages):
    for msg, buffers in messages:
        parts = [bytes(part) for part in encode(msg, *buffers)]
        yield decode(parts)


@pytest.mark.parametrize("num_positions,width", [(1, 1), (5, 3), (MAX_PROMPT_LOGPROB_ENTRIES // 21 * 2 + 7, 21)])
def test_pack_and_read_round_trip(num_positions, width):
    ids, logprobs, ranks = tables(num_positions, width)
    messages = pack("req-7", ids, logprobs, ranks)
    assert all(msg.num_positions * msg.width <= MAX_PROMPT_LOGPROB_ENTRIES for msg, _ in messages)
    assert [msg.last for msg, _ in messages] == [False] * (len(messages) - 1) + [True]
    assembler = PromptLogprobsAssembler(num_positions + 1)
    for msg, frames in over_the_wire(messages):
        assembler.add(msg, read(msg, frames))
    rows = assembler.result
    assert rows[0] is None and len(rows) == num_positions + 1
    for position in (1, num_positions // 2 + 1, num_positions):
        row, entry = position - 1, rows[position]
        prompt_token = int(ids[row, 0])
        assert next(iter(entry)) == prompt_token  # the prompt token first
        assert entry[prompt_token] == (float(logprobs[row, 0]), int(ranks[row]))
        for column in range(1, width):
            token = int(ids[row, column])
            if token != prompt_token and token not in ids[row, 1:column].tolist():
                assert entry[token] == (float(logprobs[row, column]), column)


def test_prompt_token_among_the_top_keeps_its_own_rank():
    ids = torch.tensor([[9, 9, 4]], dtype=torch.int32)
    logprobs = torch.tensor([[-0.1, -0.1, -3.0]])
    (msg, frames), = over_the_wire(pack("r", ids, logprobs, torch.tensor([1], dtype=torch.int32)))
    assert read(msg, frames) == [{9: (pytest.approx(-0.1), 1), 4: (-3.0, 2)}]


def test_one_token_prompt_is_complete_without_a_message():
    assert PromptLogprobsAssembler(1).result == [None]


def test_assembler_refuses_gaps_and_short_sets_and_keeps_the_first_complete_set():
    ids, logprobs, ranks = tables(4, 2)
    (first, frames), = over_the_wire(pack("r", ids[:2], logprobs[:2], ranks[:2]))
    gap = PromptLogprobs(**{**vars(first), "start": 3, "last": False})
    assembler = PromptLogprobsAssembler(5)
    with pytest.raises(ProtocolError, match="start at position 3, expected 1"):
        assembler.add(gap, read(first, frames))
    short = PromptLogprobsAssembler(5)
    with pytest.raises(ProtocolError, match="cover 3 positions, the prompt has 5"):
        short.add(first, read(first, frames))
    whole = PromptLogprobsAssembler(5)
    (msg, frames4), = over_the_wire(pack("r", ids, logprobs, ranks))
    whole.add(msg, read(msg, frames4))
    kept = list(whole.result)
    whole.add(msg, [{0: (0.0, 1)}] * 4)  # a second engine's set (a recompute) does not replace it
    assert whole.result == kept


def test_a_retry_starts_over():
    ids, logprobs, ranks = tables(4, 2)
    assembler = PromptLogprobsAssembler(5)
    (part, part_frames), = over_the_wire(pack("r", ids[:2], logprobs[:2], ranks[:2]))
    assembler.add(PromptLogprobs(**{**vars(part), "last": False}), read(part, part_frames))
    (whole, frames), = over_the_wire(pack("r", ids, logprobs, ranks))
    assembler.add(whole, read(whole, frames))
    assert len(assembler.result) == 5 and next(iter(assembler.result[4])) == int(ids[3, 0])


def test_bounds_are_checked_in_the_header():
    with pytest.raises(Exception, match="exceed"):
        PromptLogprobs(request_id="r", start=1, num_positions=MAX_PROMPT_LOGPROB_ENTRIES, width=2, last=True)
