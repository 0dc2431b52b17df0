"""A prefill engine under a steady load of prompts that all differ in length keeps its memory: oneDNN, which runs
the CPU linears, keeps one primitive per input shape, so the row counts it sees must come from a small fixed set
(engine/layers/linear.padded_rows) whatever the prompts, padding changes no result, a prefill engine makes every
one of them before its first prompt (so its memory does not grow towards that set while it serves), and no
per-request record is left once the requests are done."""

from __future__ import annotations

import pytest
import torch

from pdserve.control.messages import PrefillRequest
from pdserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.layers import linear as linear_module
from pdserve.engine.layers.linear import EXACT_ROWS, Linear, padded_rows
from pdserve.engine.request import SamplingParams
from pdserve.prefill.service import PrefillOptions, build_prefill_server

ROUTER = b"router"
LENGTHS = range(129, 257)  # one prompt per step: each step a row count of its own


@pytest.fixture
def server(model_factory, pack_every_linear):
    server = build_prefill_server(ModelConfig.from_hf(model_factory("llama"), dtype="float32"), CacheConfig(16, 256),
                                  SchedulerConfig(max_num_seqs=1), PrefillOptions(stream_layers=False))
    yield server
    server.close()


@pytest.fixture
def linear_shapes(monkeypatch):
    """(rows, packed weight shape) of each call that reaches oneDNN's packed linear, in order."""
    seen: list[tuple[int, tuple[int, ...]]] = []
    run = torch.ops.mkldnn._linear_pointwise

    def recording(x, weight, *args):
        seen.append((x.numel() // x.shape[-1], tuple(weight.shape)))
        return run(x, weight, *args)

    monkeypatch.setattr(linear_module.torch.ops.mkldnn, "_linear_pointwise", recording)
    return seen


@pytest.fixture
def linear_rows(linear_shapes):
    """The row counts that reach oneDNN's packed linear, one entry per call (read when the test reads it)."""

    class Rows:
        def __iter__(self):
            return iter([rows for rows, _ in linear_shapes])

    return Rows()


def uses_onednn(server) -> bool:
    return any(isinstance(m, Linear) and m.packed_weight is not None for m in server.engine.runner.model.modules())


def serve(server, lengths, first_id: int = 0) -> set[str]:
    """One prompt of each length, all added at once, run to the end; the ids that finished."""
    for i, length in enumerate(lengths, start=first_id):  # the first token its own: no prefix-cache hit
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        token_ids = [5 + i] + [3 + j % 50 for j in range(length - 1)]
        server.handle(ROUTER, PrefillRequest(request_id=f"r{i}", prompt_token_ids=token_ids, sampling_params=params))
    finished = set()
    while server.engine.has_work():
        finished |= {delta.request_id for delta in server.engine.step() if delta.finish_reason is not None}
    return finished


def test_prompts_of_every_length_reach_onednn_in_few_shapes_and_leave_nothing(server, linear_rows):
    if not uses_onednn(server):
        pytest.skip("this CPU runs no linear on oneDNN")
    finished = set()
    for i in range(len(LENGTHS)):  # one prompt per step
        finished |= serve(server, LENGTHS[i:i + 1], first_id=i)
    assert finished == {f"r{i}" for i in range(len(LENGTHS))}
    shapes = set(linear_rows)
    # 8 sizes for the prompts of one power of two, and the sampled rows (one per prompt)
    assert len(shapes) <= 9, f"{len(shapes)} row counts reached oneDNN: it keeps a primitive alive for each"
    assert shapes == {padded_rows(rows) for rows in shapes}, "only padded row counts reach oneDNN"
    engine = server.engine
    assert not engine.scheduler.requests and not server.kv_transfer.transfers and not server.continuing
    assert engine.kv_cache_manager.num_used_blocks == 0
    engine.kv_cache_manager.check_invariants()


def test_a_prefill_engine_makes_every_linear_shape_before_its_first_prompt(model_factory, linear_shapes,
                                                                         pack_every_linear):
    """Prompts of every length, several per step and chunked, reach only shapes the engine ran when it was built:
    each shape's oneDNN primitive (and the memory it keeps) exists before the first prompt."""
    server = build_prefill_server(ModelConfig.from_hf(model_factory("llama"), dtype="float32"), CacheConfig(16, 256),
                                  SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
                                  PrefillOptions(stream_layers=False))
    try:
        if not uses_onednn(server):
            pytest.skip("this CPU runs no linear on oneDNN")
        warmed = set(linear_shapes)
        linear_shapes.clear()
        lengths = list(LENGTHS)
        for i in range(0, len(lengths), 3):  # three prompts at a time: steps of two or three, and the chunks' tails
            assert len(serve(server, lengths[i:i + 3], first_id=i)) == len(lengths[i:i + 3])
        served = set(linear_shapes)
        assert len({rows for rows, _ in served}) >= 20, "the steps had many sizes"
        assert served <= warmed, f"shapes first made while serving: {sorted(served - warmed)}"
        assert server.engine.kv_cache_manager.num_used_blocks == 0
    finally:
        server.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_changes_no_row_of_a_linear(dtype, pack_every_linear):
    torch.manual_seed(0)
    layer = Linear(96, 160)
    layer.weight.data.copy_(torch.randn(160, 96))
    layer = layer.to(dtype)
    if not layer.pack_for_cpu(keep_weight=True) or layer.packed_weight is None:
        pytest.skip(f"this CPU runs no {dtype} linear on oneDNN (bf16 runs on pdserve's kernel, which pads nothing)")
    for rows in (EXACT_ROWS + 1, 37, 100, 513, 1000):
        assert padded_rows(rows) > rows, "these row counts are padded"
        x = torch.randn(rows, 96, dtype=dtype)
        unpadded = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
        assert torch.equal(layer(x), unpadded), f"{rows} rows: padding changed the result"
        assert layer(x.view(1, rows, 96)).shape == (1, rows, 160)


def test_padded_rows_are_few_and_close():
    sizes = {padded_rows(rows) for rows in range(1, 4097)}
    assert len(sizes) <= EXACT_ROWS + 8 * 8  # exact up to EXACT_ROWS, then 8 sizes per power of two
    assert all(rows <= padded_rows(rows) <= rows * 1.125 for rows in range(1, 4097))
    assert all(padded_rows(rows) == rows for rows in range(1, EXACT_ROWS + 1))
