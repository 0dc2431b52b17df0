"""The CPU paged decode attention (kernels/torch_paged.py) in bf16 computes in float32: its output is the
float32 attention of the same bf16 K/V and queries, rounded once to bf16. And decode's chunking (a few
sequences per gather) changes no result, with padded groups, windows, soft caps and sinks."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import torch_paged
from tests.kernels.paged_data import generator_for, make_paged_cache, randn

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
# Lengths that make padded groups and span several blocks; some shorter than the window, some past it.
DECODE_LENS = [1, 15, 16, 17, 40, 41, 90, 200, 260, 33, 64, 7]
OPTIONS = {
    "plain": {},
    "window": {"sliding_window": 24},
    "soft cap and sinks": {"soft_cap": 5.0, "sinks": True},
}


def _options(name: str, gen: torch.Generator) -> dict:
    options = dict(OPTIONS[name])
    window = options.pop("sliding_window", None)
    if options.pop("sinks", False):
        options["sinks"] = randn((HEADS,), torch.float32, gen)
    return {"window": window, **options}


def _decode(cache, query, options, key_cache=None, value_cache=None) -> torch.Tensor:
    plan = torch_paged.plan_decode(cache.block_tables, cache.seq_lens, BLOCK, sliding_window=options["window"])
    return torch_paged.decode_attention_planned(
        query, cache.key_cache if key_cache is None else key_cache,
        cache.value_cache if value_cache is None else value_cache, plan, HEAD_DIM**-0.5,
        options.get("soft_cap"), options.get("sinks"))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_bf16_decode_is_float32_attention_rounded_once(name, request):
    gen = generator_for(request.node.name)
    cache = make_paged_cache(DECODE_LENS, KV_HEADS, HEAD_DIM, torch.bfloat16, gen, block_size=BLOCK)
    query = randn((len(DECODE_LENS), HEADS, HEAD_DIM), torch.bfloat16, gen)
    options = _options(name, gen)
    out = _decode(cache, query, options)
    expected = _decode(cache, query.float(), options, cache.key_cache.float(), cache.value_cache.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_chunks_change_nothing(name, dtype, monkeypatch, request):
    gen = generator_for(request.node.name)
    cache = make_paged_cache(DECODE_LENS, KV_HEADS, HEAD_DIM, dtype, gen, block_size=BLOCK)
    query = randn((len(DECODE_LENS), HEADS, HEAD_DIM), dtype, gen)
    options = _options(name, gen)
    whole = _decode(cache, query, options)
    chunk_calls = []  # sequences per chunk
    softmax = torch_paged._decode_softmax  # called once per chunk, with its number of sequences last
    monkeypatch.setattr(torch_paged, "_decode_softmax", lambda *args: chunk_calls.append(args[-1]) or softmax(*args))
    monkeypatch.setattr(torch_paged, "DECODE_CHUNK_ELEMENTS", 48 * KV_HEADS * HEAD_DIM)  # 1 to 3 sequences a chunk
    chunked = _decode(cache, query, options)
    assert max(chunk_calls) < len(DECODE_LENS) and sum(chunk_calls) == len(DECODE_LENS)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
