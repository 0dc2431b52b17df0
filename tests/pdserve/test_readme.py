"""The README is a front door that works as written: short, a first request early, results linked to their
sections, the client examples bound their answers, and the install commands say what they download. Every
shell block of the README and docs/ is checked by tests/docs/test_doc_commands.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def test_readme_is_a_front_door():
    lines = README.splitlines()
    assert len(lines) <= 120, "the README stays short: details go to docs/"
    first_request = next(i for i, line in enumerate(lines, 1) if line.startswith("curl "))
    assert first_request <= 50, "a first request within the README's first 50 lines"
    for heading in ("## Set up", "## First request", "## Results at a glance", "## Where to go next"):
        assert heading in lines


def test_readme_results_link_to_sections_of_results_md():
    results = (REPO / "docs" / "results.md").read_text()
    anchors = {anchor(line) for line in results.splitlines() if line.startswith("## ")}
    table = README.split("## Results at a glance")[1].split("## ")[0]
    linked = re.findall(r"\(docs/results\.md#([^)]+)\)", table)
    assert 4 <= len(linked) <= 6 and set(linked) <= anchors, (linked, anchors)


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading line."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


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


def test_router_overhead_without_httpx_says_how_to_get_it():
    moved = (REPO / "experiments" / "router_overhead.py").exists()
    load = "sys.path.insert(0, 'experiments'); import router_overhead" if moved else "import pdserve.bench.router_overhead"
    code = ("import sys; sys.modules['httpx'] = None\n"
            f"try:\n    {load}\n"
            "except ImportError as exc:\n    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert 'pip install "pdserve[bench]"' in result.stdout, result.stdout + result.stderr
