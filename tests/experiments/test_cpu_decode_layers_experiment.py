"""The one-call decode experiment runs both ways at toy size and prints both and their ratio."""

from __future__ import annotations

import pytest

from pdserve.kernels import cpu_decode_layers
from tests.experiments import load_experiment

main = load_experiment("cpu_decode_layers").main


@pytest.mark.skipif(not cpu_decode_layers.available(), reason="the native CPU kernels do not build here")
def test_both_ways_are_timed_in_turns(model_factory, capsys):
    assert main(["--model", model_factory("llama"), "--threads", "1", "--batch", "2", "--num-prompts", "2",
                 "--prompt-len", "8", "--new-tokens", "4", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 thread(s), batch 2, 8 in / 4 out, 2 prompts, 2 rounds in turns" in out
    for way in ("one call", "layer by layer"):
        line = next(line for line in out.splitlines() if line.strip().startswith(way))
        assert line.count(" / ") == 2 and "median" in line  # two rounds of steps and of tok/s
    assert "one call against layer by layer: decode step" in out


def test_a_model_without_the_one_call_path_is_refused_with_a_sentence(model_factory):
    with pytest.raises(SystemExit, match="layer by layer"):
        main(["--model", model_factory("mistral", sliding_window=8), "--rounds", "1"])
