"""ForwardContext.cached: built once per forward pass, rebuilt when the context is installed again."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.forward_context import ForwardContext, get_forward_context, use_forward_context


def _context() -> ForwardContext:
    empty = torch.zeros(0, dtype=torch.int32)
    return ForwardContext(torch.zeros(0, dtype=torch.int64), 0, empty, empty, empty, empty, empty)


def test_cached_builds_once_per_installation():
    context, builds = _context(), []
    for _ in range(2):  # e.g. a warm-up run then a CUDA graph capture with the same context
        with use_forward_context(context):
            assert get_forward_context() is context
            for _layer in range(3):
                value = context.cached("plan", lambda: builds.append(1) or len(builds))
            assert value == len(builds)
    assert len(builds) == 2
    with pytest.raises(RuntimeError, match="outside a forward pass"):
        get_forward_context()


def test_contexts_cannot_nest():
    with use_forward_context(_context()):
        with pytest.raises(RuntimeError, match="cannot nest"):
            with use_forward_context(_context()):
                pass
