"""Fuzz the decode engine's KV writer (hypothesis): a KVLayer that the wire accepted, from a peer that may
lie about layers, tokens, heads or dtype, is either refused by `layer_problem` with a reason, or written
into exactly the slots of the request's asked-for tokens, never anywhere else in the cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve.decode.incoming import IncomingTransfer
from pdserve.decode.kv_writer import KVWriter
from pdserve.kvtransfer.messages import KVLayer

pytestmark = pytest.mark.fuzz

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 12, 4, 2, 4
CANARY = -7.0


class _Request:  # the writer reads nothing of the request; IncomingTransfer names it
    request_id = "req-0"


@st.composite
def transfers(draw):
    """(incoming, layer message, payload): the request's blocks and asked-for tokens, and a KVLayer
    shaped by a peer that may overreach in any dimension."""
    block_ids = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=4, unique=True))
    skip_tokens = BLOCK_SIZE * draw(st.integers(0, len(block_ids) - 1))
    num_tokens = draw(st.integers(1, len(block_ids) * BLOCK_SIZE - skip_tokens))
    incoming = IncomingTransfer(_Request(), (torch.tensor(block_ids, dtype=torch.int64),), skip_tokens, num_tokens,
                                address="tcp://127.0.0.1:1")
    incoming.first_positions = (skip_tokens,) * NUM_LAYERS  # every layer full: each carries every asked token
    lie = draw(st.sampled_from([None, None, None, "layers", "tokens", "heads", "dtype"]))  # one at most
    layer_start = draw(st.integers(0, NUM_LAYERS - 1))
    layer_end = draw(st.integers(layer_start + 1, NUM_LAYERS + (2 if lie == "layers" else 0)))
    token_start = draw(st.integers(0, num_tokens - 1))
    tokens = draw(st.integers(1, num_tokens - token_start + (2 if lie == "tokens" else 0)))
    heads, head_dim = draw(st.sampled_from([(KV_HEADS + 1, HEAD_DIM), (KV_HEADS, 2)])) if lie == "heads" \
        else (KV_HEADS, HEAD_DIM)
    dtype = torch.float16 if lie == "dtype" else torch.float32
    payload = torch.randn(layer_end - layer_start, 2, tokens, heads, head_dim).to(dtype)
    msg, frame = KVLayer.from_tensor(payload, request_id="req-0", layer_start=layer_start, token_start=token_start)
    return incoming, msg, bytes(frame)


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=transfers())
def test_a_layer_is_refused_or_lands_only_in_the_asked_slots(case):
    incoming, msg, frame = case
    kv_cache = torch.full((NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), CANARY)
    writer = KVWriter(kv_cache)
    problem = writer.layer_problem(incoming, msg)
    event("refused" if problem else "written")
    if problem is not None:
        assert problem.strip()
        assert (kv_cache == CANARY).all()
        return
    kv = msg.tensor(frame)  # [num_layers, 2, num_tokens, heads, head_dim]
    writer.write(incoming, msg, kv)
    expected = torch.full_like(kv_cache, CANARY)
    for offset in range(msg.num_tokens):
        position = incoming.skip_tokens + msg.token_start + offset  # in the prompt
        block, slot = int(incoming.block_ids[0][position // BLOCK_SIZE]), position % BLOCK_SIZE
        expected[msg.layer_start:msg.layer_end, :, block, slot] = kv[:, :, offset]
    assert torch.equal(kv_cache, expected)
