"""The engine profile runs on a tiny model and lists the ops that took the time."""

from __future__ import annotations

from tests.experiments import load_experiment

main = load_experiment("profile_engine").main


def test_profile_lists_the_timed_generate_and_its_ops(model_factory, capsys):
    assert main(["--model", model_factory("llama"), "--num-prompts", "2", "--prompt-len", "16", "--max-tokens", "4",
                 "--rows", "40"]) == 0
    out = capsys.readouterr().out
    assert "generate:" in out and "for 2 x 16 prompt tokens and 2 x 4 output tokens" in out
    assert "Self CPU time total" in out
    # linears on oneDNN or F.linear are ops of the table; on pdserve's C kernels (bf16, or float32 without
    # AVX-512) the profile says it cannot see them
    assert "linear" in out.split("Self CPU time total")[0] or "linears run on pdserve's C kernels" in out


def test_parts_time_the_engine_and_are_restored_after(model_factory, capsys):
    from pdserve.engine.model_runner import ModelRunner

    prepare = ModelRunner.prepare
    assert main(["--model", model_factory("llama"), "--num-prompts", "2", "--prompt-len", "16", "--max-tokens", "4",
                 "--parts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    total = float(lines[0].split("(")[1].split(" s")[0])  # "generate: W s (C s of this thread's CPU) ..."
    parts = {line[:26].strip(): float(line[26:].split(" s")[0]) for line in lines[1:]}
    assert {"engine step", "forward + logits", "linears (lm_head too)", "decode attention"} <= parts.keys()
    assert parts["forward + logits"] <= parts["engine step"] <= total + 0.01  # as printed: 2 and 3 decimals
    assert ModelRunner.prepare is prepare  # the wrappers are gone
