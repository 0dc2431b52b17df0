"""Dependencies point one way (docs/design/structure.md): each package imports only the packages below it."""

from __future__ import annotations

import ast
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
}


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
