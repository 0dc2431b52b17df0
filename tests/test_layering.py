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
    # the torch-free engine modules the router shares
    "router": {"control", "engine.tokenizer", "engine.detokenizer", "engine.block_pool", "engine.generation_defaults",
               "engine.chat", "engine.grammar"},
    # `pdserve bench` and `sweep`: any OpenAI-compatible server, and `pdserve up` as a subprocess
    "bench": {"cli_help", "router_cli", "engine.config", "engine.tokenizer"},
    # `pdserve profile` and `plan`: bench's datasets and metrics, the public engine API, the wire and the KV link
    # it times; never the router, never the engine's internals
    "planner": {"bench", "cli_help", "LLM", "SamplingParams", "demo_model", "local_cluster", "engine.config",
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
