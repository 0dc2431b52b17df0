"""The `pdserve` command line as a new user meets it: --help with every option explained and its default
shown, --version, distinct names for counts and addresses (old spellings warn), one-line errors."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.serve_vllm_args import RefusedFlag
from pdserve.cli import build_parser, main
from pdserve.cli_help import DeprecatedFlag

REPO = Path(__file__).resolve().parents[2]


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subparsers.choices)


def test_every_option_of_every_subcommand_has_help_text():
    missing = []
    for name, parser in subcommand_parsers().items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, DeprecatedFlag, RefusedFlag)):
                continue  # deprecated spellings and refused vLLM flags are hidden on purpose
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help text: {', '.join(missing)}"


def test_help_shows_defaults(capsys):
    parsers = subcommand_parsers()
    assert {"up", "router", "prefill", "decode", "generate", "demo-model", "keygen"} <= set(parsers)
    up_help = parsers["up"].format_help()
    assert "--block-size BLOCK_SIZE" in up_help and "(default: 16)" in up_help
    assert "(default: prefix_aware)" in up_help, "policy defaults are shown"
    assert "(default: None)" not in up_help, "no default is not shown as None"
    assert "(default: 1)" in parsers["up"].format_help(), "--num-prefill's default"


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"pdserve {version('pdserve')}"


def test_counts_and_addresses_have_different_names_and_old_spellings_warn(capsys):
    parser = build_parser()
    up = parser.parse_args(["up", "--num-prefill", "0", "--num-decode", "2"])
    assert (up.num_prefill, up.num_decode) == (0, 2)
    assert (parser.parse_args(["up"]).num_prefill, parser.parse_args(["up"]).num_decode) == (1, 1)
    router = parser.parse_args(["router", "--prefill-address", "tcp://a:1", "--prefill-address", "tcp://b:1",
                                "--decode-address", "tcp://c:1"])
    assert router.prefill_address == ["tcp://a:1", "tcp://b:1"] and router.decode_address == ["tcp://c:1"]
    assert capsys.readouterr().err == ""
    old_up = parser.parse_args(["up", "--prefill", "0", "--decode", "3"])
    assert (old_up.num_prefill, old_up.num_decode) == (0, 3)
    old_router = parser.parse_args(["router", "--prefill", "tcp://a:1", "--prefill-address", "tcp://b:1",
                                    "--decode", "tcp://c:1"])
    assert old_router.prefill_address == ["tcp://a:1", "tcp://b:1"] and old_router.decode_address == ["tcp://c:1"]
    err = capsys.readouterr().err
    assert "--prefill is deprecated" in err and "use --num-prefill" in err and "use --prefill-address" in err
    assert parser.parse_args(["router"]).prefill_address == [], "the default list is not shared between parses"


def test_engines_get_a_host_derived_id_by_default():
    import socket

    from pdserve.engines import default_engine_id

    assert build_parser().parse_args(["decode"]).engine_id is None
    assert default_engine_id("decode") == f"decode-{socket.gethostname()}"


def test_demo_model_refuses_a_non_empty_directory_without_force(tmp_path, capsys):
    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["demo-model", str(target), "--size", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--force" in err and err.count("\n") == 1, "one line that names the fix"
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    assert main(["demo-model", str(target), "--size", "tiny", "--force"]) == 0
    assert (target / "config.json").is_file() and (target / "notes.txt").is_file()
    assert main(["demo-model", str(tmp_path / "fresh"), "--size", "tiny"]) == 0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_cuda_device_without_cuda_is_one_line_naming_the_fix(model_factory):
    result = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--model", model_factory("llama"),
                             "--device", "cuda", "--num-prompts", "1"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("pdserve generate: error: device='cuda'") and "--device cpu" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_placeholder_model_path_is_one_line_naming_the_fix():
    result = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--model", "path/to/hf-model-dir"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'path/to/hf-model-dir' does not exist and is not a Hugging Face hub id" in result.stderr


def test_up_log_pruning_keeps_the_newest_even_when_folder_times_tie(tmp_path, monkeypatch):
    """Folders made within one clock tick share their mtime: the order must come from their names."""
    import os

    from pdserve.up import new_log_dir

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    made = []
    for _ in range(6):
        made.append(new_log_dir(keep=3))
        for path in (tmp_path / "logs").iterdir():
            os.utime(path, ns=(10**18, 10**18))  # one tick for every folder
    assert sorted((tmp_path / "logs").iterdir()) == made[-3:]


def test_up_logs_go_to_a_fresh_folder_under_the_cache_and_old_ones_are_pruned(tmp_path, monkeypatch):
    from pdserve.up import new_log_dir

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    made = [new_log_dir(keep=3) for _ in range(5)]
    assert all(path.parent == tmp_path / "logs" and path.name.startswith("up-") for path in made)
    assert len(set(made)) == 5, "each run its own folder"
    assert sorted((tmp_path / "logs").iterdir()) == sorted(made[-3:]), "only the newest are kept"
