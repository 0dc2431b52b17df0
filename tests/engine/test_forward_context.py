"""use_forward_context: the backend prepares the step once per installation; contexts do not nest."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention.torch_paged import TorchPagedBackend
from pdserve.engine.forward_context import ForwardContext, get_forward_context, use_forward_context


def _context() -> ForwardContext:
    empty = torch.zeros(0, dtype=torch.int32)
    return ForwardContext(torch.zeros(0, dtype=torch.int64), 0, empty, empty, empty, empty, empty)


class CountingBackend(TorchPagedBackend):
    def __init__(self) -> None:
        super().__init__(block_size=4)
        self.prepared: list[object] = []

    def prepare(self, context: ForwardContext):
        self.prepared.append(super().prepare(context))
        return self.prepared[-1]


def test_prepare_runs_once_per_installation():
    context, backend = _context(), CountingBackend()
    for _ in range(2):  # e.g. a warm-up run then a CUDA graph capture with the same context
        with use_forward_context(context, backend):
            assert get_forward_context() is context
            assert context.attn_metadata is backend.prepared[-1]
    assert len(backend.prepared) == 2 and backend.prepared[0] is not backend.prepared[1]
    with pytest.raises(RuntimeError, match="outside a forward pass"):
        get_forward_context()


def test_contexts_cannot_nest():
    backend = CountingBackend()
    with use_forward_context(_context(), backend):
        with pytest.raises(RuntimeError, match="cannot nest"):
            with use_forward_context(_context(), backend):
                pass
    assert len(backend.prepared) == 1
