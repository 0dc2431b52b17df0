"""The mixed-step timing drives a real engine through the three kinds of step it compares."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.plan_mixed_steps import measure, shape
from pdserve.bench.plan_profile import EngineProbe, one_core


def test_each_kind_of_step_is_timed_and_the_engine_is_left_empty(model_factory):
    with one_core(None):
        probe = EngineProbe(model_factory(), "cpu", 256)
        decode, alone, mixed = measure(probe, decodes=2, prompt_len=16, context=8)
        assert decode > 0 and alone > 0 and mixed > 0
        assert not probe.engine.has_work()  # the decodes were drained, nothing leaks into the next shape


def test_shapes_on_the_command_line_are_checked():
    assert shape("8,128") == (8, 128)
    for bad, said in (("8x128", "is not K,N"), ("8,128,1", "is not K,N"), ("0,128", "1 or more"), ("8,0", "1 or more")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            shape(bad)
