"""The README works as written: every `pdserve` command in its code blocks is a real command line, the
client example bounds its answer, and the install commands say what they download."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from pdserve.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def shell_commands() -> list[list[str]]:
    """Each `pdserve ...` command of the README's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for language, body in BLOCK.findall(README):
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["pdserve"]:
                    commands.append(words[1:])
    return commands


def test_every_readme_pdserve_command_parses(capsys):
    commands = shell_commands()
    assert len(commands) >= 12
    parser = build_parser()
    for argv in commands:
        argv = [word.replace("~", str(Path.home())) for word in argv]
        parser.parse_args(argv)  # SystemExit(2) on an unknown flag or a bad value
    assert "deprecated" not in capsys.readouterr().err, "the README uses the current flag names"
    generate = [c for c in commands if c[:1] == ["generate"]]
    assert any(parser.parse_args(c).prompt and len(parser.parse_args(c).prompt) > 1 for c in generate), \
        "the README shows several prompts"
    assert any(c[:1] == ["keygen"] for c in commands)


def test_readme_attaches_static_engines_and_names_the_served_model():
    routers = [build_parser().parse_args(c) for c in shell_commands() if c[:1] == ["router"]]
    static = [r for r in routers if r.registration_address == "none"]
    assert static and static[0].prefill_address and static[0].decode_address
    assert all(r.model is None or r.served_model_name for r in routers), \
        "a router given --model names what clients send, or the README's pdserve-demo requests would 404"


def test_readme_client_examples_bound_their_answers():
    python_blocks = [body for language, body in BLOCK.findall(README) if language == "python"]
    client = next(body for body in python_blocks if "chat.completions.create" in body)
    assert "max_tokens=" in client
    for _, body in BLOCK.findall(README):
        if "/v1/chat/completions" in body and "curl" in body:
            assert '"max_tokens"' in body


def test_readme_is_honest_about_what_torch_downloads():
    assert "on a CPU machine it is the CPU wheel" not in README
    assert "https://download.pytorch.org/whl/cpu" in README and "CUDA build" in README
    install = "python3 -m pip install torch==2.13.0 && python3 -m pip install -e"
    assert README.count(install) == 2, "both set-up commands stay as they are"
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install --quiet --disable-pip-version-check torch==2.13.0\n" in ci, "CI keeps the local wheel"


def test_bench_module_without_httpx_says_how_to_get_it():
    code = ("import sys; sys.modules['httpx'] = None\n"
            "try:\n    import pdserve.bench.router_overhead\n"
            "except ImportError as exc:\n    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert 'pip install "pdserve[bench]"' in result.stdout, result.stdout + result.stderr
