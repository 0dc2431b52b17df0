"""The engine profile runs on a tiny model and lists the ops that took the time."""

from __future__ import annotations

from tests.experiments import load_experiment

main = load_experiment("profile_engine").main


def test_profile_lists_the_timed_generate_and_its_ops(model_factory, capsys):
    assert main(["--model", model_factory("llama"), "--num-prompts", "2", "--prompt-len", "16", "--max-tokens", "4",
                 "--rows", "40"]) == 0
    out = capsys.readouterr().out
    assert "generate:" in out and "for 2 x 16 prompt tokens and 2 x 4 output tokens" in out
    assert "Self CPU time total" in out and "linear" in out
