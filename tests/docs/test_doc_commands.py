"""Every shell block of README.md and docs/ works as written, or says what it needs.

A fenced block tagged bash, sh, shell or console is a shell block. The line before it may mark it
`<!-- needs: gpu hub containers kubernetes root -->` (any of these); see docs/getting-started.md. Every block is
checked statically: a `pdserve` command is parsed by pdserve's own parser (a wrong flag or value fails), a path it
names exists, a program it runs is one this test knows, and programs CI has no means to run (docker, kubectl) only
appear in blocks marked for them. The blocks that run in seconds run: the ones made only of `pdserve keygen`,
`pdserve demo-model --size tiny` and `pdserve generate --model ...`, and the README's first requests (curl and the
openai client) against a real `pdserve up` on the tiny model. Sweeps, profiles and servers that take minutes are
parsed, not run. Every relative link resolves, to a file and to a heading when it names one."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if REPO / "docs" / "results" not in p.parents)]
SHELL = {"bash", "sh", "shell", "console"}
MARKS = {"gpu", "hub", "containers", "kubernetes", "root"}
MARK = re.compile(r"^<!-- needs: ([a-z ]+) -->$")
FENCE = re.compile(r"^```(\S*)")
OPERATORS = {"&&", "||", ";", "|", "&"}
# programs that only run where a block is marked for them
NEEDS_MARK = {"docker": "containers", "podman-compose": "containers", "podman": "containers", "kubectl": "kubernetes"}
# programs whose commands this test checks no further than their name
PLAIN = {"cd", "export", "mkdir", "wait", "kill", "pip", "transformers"}


@dataclass
class Block:
    path: Path
    line: int
    language: str
    body: str
    needs: frozenset[str]

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(previous)
            needs = frozenset(mark.group(1).split()) if mark else frozenset()
            found.append(Block(path, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n", needs))
            i = end + 1
    return found


def shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.language in SHELL]


def commands(body: str) -> list[list[str]]:
    """The block's commands as word lists: continuation lines joined, comments dropped, split at && ; | &,
    leading VAR=value assignments dropped."""
    found = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token not in OPERATORS:
                words.append(token)
                continue
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words.pop(0)
            if words:
                found.append(words)
            words = []
    return found


def parse_pdserve(argv: list[str], where: str, capsys) -> None:
    try:
        build_parser().parse_args([word.replace("~", str(Path.home())) for word in argv])
    except SystemExit as exc:
        pytest.fail(f"{where}: `pdserve {' '.join(argv)}` is refused by pdserve's parser ({exc.code}): "
                    f"{capsys.readouterr().err.strip()}")
    assert "deprecated" not in capsys.readouterr().err, f"{where}: `pdserve {' '.join(argv)}` uses an old flag name"


def check_python(argv: list[str], where: str, capsys) -> None:
    """python -m pytest|pip|pdserve|MODULE ..., or python SCRIPT.py ..."""
    if argv[:1] == ["-m"]:
        module, rest = argv[1], argv[2:]
        if module == "pdserve":
            parse_pdserve(rest, where, capsys)
        elif module == "pytest":
            for word in rest:
                if word.startswith("tests/"):
                    assert (REPO / word.split("::")[0]).exists(), f"{where}: {word} does not exist"
        elif module != "pip":
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        return
    script = REPO / argv[0]
    assert script.is_file(), f"{where}: {argv[0]} does not exist"
    source = script.read_text()
    # options a script takes from a sibling module it imports (experiments/ab_runs.py's add_load_args)
    for sibling in re.findall(r"^from (\w+) import", source, re.M):
        if (script.parent / f"{sibling}.py").is_file():
            source += (script.parent / f"{sibling}.py").read_text()
    for flag in (word.split("=")[0] for word in argv[1:] if word.startswith("--")):
        assert f'"{flag}"' in source, f"{where}: {argv[0]} has no option {flag}"


def check_command(words: list[str], block: Block, capsys) -> None:
    program, argv, where = words[0], words[1:], block.where()
    if program in NEEDS_MARK:
        assert NEEDS_MARK[program] in block.needs, \
            f"{where}: `{program}` runs only where CI has it: mark the block <!-- needs: {NEEDS_MARK[program]} -->"
    elif program == "pdserve":
        parse_pdserve(argv, where, capsys)
    elif program in ("python", "python3", ".venv/bin/python"):
        check_python(argv, where, capsys)
    elif program == "curl":
        urls = [word for word in argv if word.startswith("http")]
        assert urls and all(re.match(r"https?://(127\.0\.0\.1|localhost|\[::1\])[:/]", url) for url in urls), where
        for i, word in enumerate(argv[:-1]):
            if word in ("-d", "--data"):
                json.loads(argv[i + 1])
    elif program == "bash":
        assert (REPO / argv[0]).is_file(), f"{where}: {argv[0]} does not exist"
    elif program.startswith(("deploy/", "experiments/", "./")):
        assert (REPO / program).is_file(), f"{where}: {program} does not exist"
    else:
        assert program in PLAIN, f"{where}: `{program}` is a program this test does not know: " \
                                 "mark the block (<!-- needs: ... -->) or teach tests/docs/test_doc_commands.py"


def test_every_code_block_names_its_language():
    """An untagged fence could hold a shell command that escapes the checks below."""
    untagged = [b.where() for b in blocks() if not b.language]
    assert not untagged, f"tag these code blocks (bash, python, text, ...): {untagged}"


def test_every_mark_is_known_and_sits_on_a_shell_block():
    marked = {b.where(): b.needs for b in shell_blocks() if b.needs}
    for block in shell_blocks():
        assert block.needs <= MARKS, f"{block.where()}: unknown marks {set(block.needs - MARKS)}; known: {MARKS}"
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- needs"):
                assert MARK.match(line), f"{path.name}:{i + 1}: write marks as <!-- needs: gpu hub -->"
                following = next(j for j in range(i + 1, len(lines)) if lines[j].strip())
                assert f"{path.relative_to(REPO)}:{following + 1}" in marked, \
                    f"{path.name}:{i + 1}: a mark must be the line before a shell block"


def test_every_shell_command_is_known_and_parses(capsys):
    checked = 0
    for block in shell_blocks():
        for words in commands(block.body):
            check_command(words, block, capsys)
            checked += 1
    assert checked >= 60, f"only {checked} commands found: is the block parser broken?"


def test_the_docs_show_the_commands_readers_need():
    pdserve = [c[1:] for b in shell_blocks() for c in commands(b.body) if c[0] == "pdserve"]
    parser = build_parser()
    routers = [parser.parse_args(c) for c in pdserve if c[:1] == ["router"]]
    static = [r for r in routers if r.registration_address == "none"]
    assert static and static[0].prefill_address and static[0].decode_address, "engines attached by address"
    assert all(r.model is None or r.served_model_name for r in routers), \
        "a router given --model names what clients send, or the docs' pdserve-demo requests would 404"
    assert any(c[:1] == ["keygen"] for c in pdserve)
    generate = [parser.parse_args(c) for c in pdserve if c[:1] == ["generate"]]
    assert any(g.prompt and len(g.prompt) > 1 for g in generate), "several prompts for pdserve generate"


RUNNABLE = {"keygen", "demo-model", "generate"}


def runs_in_seconds(block: Block) -> bool:
    found = commands(block.body)
    return bool(found) and not block.needs and all(
        c[0] == "pdserve" and c[1] in RUNNABLE
        and (c[1] != "demo-model" or "tiny" in c) and (c[1] != "generate" or "--model" in c) for c in found)


def test_the_quick_blocks_run(tmp_path):
    quick = [b for b in shell_blocks() if runs_in_seconds(b)]
    assert quick, "the docs show at least one block that runs as written (pdserve demo-model and generate)"
    pdserve = Path(sys.executable).with_name("pdserve")
    env = {"HOME": str(tmp_path), "PDSERVE_CACHE": str(tmp_path / "cache"), "PATH": f"{pdserve.parent}:/usr/bin:/bin"}
    for block in quick:
        body = block.body.replace("/tmp/", f"{tmp_path}/")  # the docs' scratch paths, private to this run
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{block.where()} failed:\n{result.stdout}\n{result.stderr}"


def test_the_readme_first_requests_run(model_factory, tmp_path):
    from tests.router.conftest import UpProcess

    readme = [b for b in blocks() if b.path.name == "README.md"]
    curl = next(b for b in readme if b.language == "bash" and b.body.startswith("curl "))
    client = next(b for b in readme if b.language == "python" and "chat.completions.create" in b.body)
    up = UpProcess(model_factory("llama"), tmp_path / "logs", "--served-model-name", "pdserve-demo")
    try:
        if shutil.which("curl"):
            result = subprocess.run(["bash", "-c", curl.body.replace("http://127.0.0.1:8000", up.url)],
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 0 and "data: [DONE]" in result.stdout, result.stdout + result.stderr
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(client.body.replace("http://127.0.0.1:8000", up.url), {})  # noqa: S102 - the README's own example
        assert printed.getvalue().strip(), "the openai example prints the reply"
    finally:
        assert up.stop() == 0, up.logs()


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    headings = [line for line in path.read_text().splitlines() if re.match(r"^#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lstrip("#").strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves():
    broken = []
    for path in DOCS:
        for target in LINK.findall(path.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_results_md_stays_one_page():
    """One current table per claim: a re-measurement replaces its table (history is git), so the page stays short."""
    assert len((REPO / "docs" / "results.md").read_text().splitlines()) <= 400


def test_docs_results_holds_only_what_results_md_cites():
    """Raw files stay small and current: each folder of docs/results is linked from docs/results.md, the whole is
    at most 5 MB, and no run's lock, progress or start/finish marker is kept."""
    folder = REPO / "docs" / "results"
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 5 * 2**20
    markers = [p.name for p in files if p.suffix in (".lock", ".progress") or p.name in ("started", "finished")]
    assert not markers, markers
    cited = set(LINK.findall((REPO / "docs" / "results.md").read_text()))
    for sub in folder.iterdir():
        assert any(target.startswith(f"results/{sub.name}/") for target in cited), f"{sub.name} is cited nowhere"
