"""Dependencies point one way (docs/design/structure.md): each package imports only the packages below it."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# package -> the pdserve packages it may import (besides itself)
ALLOWED = {
    "kernels": set(),
    "control": set(),
    # the engine speaks the wire's types (SamplingParams in, TokenDelta out), never its sockets or loop;
    # LLM(None) builds the demo model
    "engine": {"kernels", "demo_model", "control.errors", "control.schema", "control.sampling_params",
               "control.messages"},
    "kvtransfer": {"control"},
    "prefill": {"engine", "kernels", "control", "kvtransfer"},
    "decode": {"engine", "kernels", "control", "kvtransfer"},
    # the engine that takes either role: both roles' servers and connectors side by side
    "dualrole": {"engine", "kernels", "control", "kvtransfer", "prefill", "decode"},
    # the torch-free engine modules the router shares
    "router": {"control", "engine.tokenizer", "engine.detokenizer", "engine.block_pool", "engine.generation_defaults",
               "engine.chat", "engine.grammar", "engine.grammar_sandbox", "engine.grammar_worker"},
    # `pdserve bench` and `sweep`: any OpenAI-compatible server, and `pdserve up` as a subprocess
    "bench": {"cli_help", "progress", "router_cli", "engine.config", "engine.tokenizer"},
    # `pdserve profile` and `plan`: bench's datasets and metrics, the public engine API, the wire and the KV link
    # it times; never the router, never the engine's internals
    "planner": {"bench", "cli_help", "progress", "LLM", "SamplingParams", "demo_model", "local_cluster", "engine.config",
                "engine.tokenizer", "control", "kvtransfer", "prefill.kv_sender", "kernels.length_groups"},
}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
INSTALLED = sorted(set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()))  # the folders the wheel holds


def pdserve_imports(path: Path) -> set[str]:
    """'engine.request', 'control', ... : every pdserve module a file imports, without the prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve"):
            base = node.module.removeprefix("pdserve").lstrip(".")
            found.update(f"{base}.{alias.name}".strip(".") if not base else base for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name.removeprefix("pdserve.") for alias in node.names
                         if alias.name.startswith("pdserve."))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_lies_below_it(package):
    allowed = ALLOWED[package]
    for path in sorted((REPO / package).rglob("*.py")):
        for module in pdserve_imports(path):
            top = module.split(".")[0]
            if top == package or top in ("", "__future__"):
                continue
            ok = top in allowed or any(module == name or module.startswith(name + ".") for name in allowed)
            assert ok, f"{path.relative_to(REPO)} imports pdserve.{module}: {package} may import only {sorted(allowed)}"


def installed_files() -> list[Path]:
    return [path for folder in INSTALLED for path in sorted((REPO / folder).rglob("*.py"))]


def test_only_the_command_line_imports_bench_and_planner():
    for path in installed_files():
        if path == REPO / "pdserve" / "cli.py":
            continue
        own = path.relative_to(REPO).parts[0]
        for module in pdserve_imports(path):
            top = module.split(".")[0]
            if top in ("bench", "planner") and top != own and not (own == "planner" and top == "bench"):
                raise AssertionError(f"{path.relative_to(REPO)} imports pdserve.{module}: only pdserve/cli.py "
                                     f"(and the planner, of bench) may import bench or planner")


def test_nothing_installed_imports_an_experiment():
    scripts = {path.stem for path in (REPO / "experiments").glob("*.py")} | {"experiments"}
    for path in installed_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found = [name for name in names if name.split(".")[0] in scripts]
            assert not found, f"{path.relative_to(REPO)} imports {found}: experiments/ is not installed"


def test_the_experiments_folder_is_not_installed():
    assert "experiments" not in INSTALLED and list((REPO / "experiments").glob("*.py"))


def test_every_bench_and_planner_module_serves_a_command():
    """bench/ and planner/ are installed for `pdserve bench | sweep | profile | plan`: each of their modules is
    reached from pdserve/cli.py's imports (a measurement script no command runs belongs in experiments/)."""
    served = {"bench.mock_server"}  # the mock server: `python -m pdserve.bench.mock_server`, bench's ceiling and tests
    reached, todo = set(), ["cli"]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        path = REPO / "pdserve" / f"{module}.py" if "." not in module else \
            REPO / module.split(".")[0] / Path(*module.split(".")[1:]).with_suffix(".py")
        if path.is_file():
            todo.extend(name for name in imported_modules(path) if name.split(".")[0] in ("bench", "planner")
                        or module == "cli")
    for folder in ("bench", "planner"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            assert module in reached or module in served, \
                f"{path.relative_to(REPO)}: no pdserve command imports it; a script goes in experiments/"


def imported_modules(path: Path) -> set[str]:
    """Every pdserve module a file imports, `from pdserve.x import y` read as both x and x.y (y may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve."):
            base = node.module.removeprefix("pdserve.")
            found.update({base, *(f"{base}.{alias.name}" for alias in node.names)})
        elif isinstance(node, ast.Import):
            found.update(alias.name.removeprefix("pdserve.") for alias in node.names if alias.name.startswith("pdserve."))
    return found
