"""pdserve installs one import package, `pdserve`, whatever the repository's folders are called."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("engine", "engine.attention", "engine.layers", "engine.models", "kernels", "control", "kvtransfer",
               "prefill", "decode", "dualrole", "router", "bench", "planner", "planner.profile", "planner.model", "planner.search",
               "planner.validate")


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**_clean_env(), **env})


def _clean_env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source") / "pdserve"
    # built from a copy: setuptools leaves a build/ folder beside the pyproject it builds
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "tests", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(source)], check=True, timeout=300, capture_output=True)
    (built,) = out.glob("pdserve-*.whl")
    return built


def test_the_wheel_holds_only_the_pdserve_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/")[0] for name in archive.namelist()}
        names = set(archive.namelist())
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"pdserve"}
    for package in SUBPACKAGES:
        assert f"pdserve/{package.replace('.', '/')}/__init__.py" in names, package
    # only pdserve's own modules: no experiment, no shell script, no data file but the CPU kernels' C sources and headers
    folders = {name.rsplit("/", 1)[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert folders == {"pdserve"} | {f"pdserve/{package.replace('.', '/')}" for package in SUBPACKAGES}
    assert {name for name in names if not name.endswith(".py") and ".dist-info/" not in name} == {
        f"pdserve/kernels/{source.name}" for source in (REPO / "kernels").glob("*.[ch]")}  # every one of them
    assert not any("experiments" in name for name in names)


def test_the_installed_wheel_imports_every_subpackage_from_itself(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                    "--target", str(site), str(wheel)], check=True, timeout=300, capture_output=True)
    code = ("import importlib, sys\n"
            f"for name in {SUBPACKAGES!r}:\n"
            "    module = importlib.import_module('pdserve.' + name)\n"
            f"    assert module.__file__.startswith({str(site)!r}), module.__file__\n"
            "from pdserve import LLM, SamplingParams\n"
            "print('ok', 'torch' in sys.modules)")
    result = _python(code, tmp_path, PYTHONPATH=str(site))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "True"]  # LLM pulls in torch only when asked for


def test_outside_the_checkout_only_pdserve_imports(tmp_path):
    # The generic names of the repository's folders do not reach pdserve's folders once it is installed
    # (`kernels` may be Hugging Face's package, a dependency of transformers >= 5.25).
    for name in ("engine", "kernels", "router", "bench", "planner", "experiments", "kvtransfer", "prefill", "decode",
                 "control"):
        result = _python(f"import importlib.util; spec = importlib.util.find_spec({name!r}); "
                         "print(spec.origin if spec else None)", tmp_path)
        assert result.returncode == 0 and str(REPO) not in result.stdout, (name, result.stdout, result.stderr)
    result = _python("import sys, pdserve, pdserve.kernels, pdserve.engine.layers.attention;"
                     "print(pdserve.kernels.__name__, 'torch' in sys.modules)", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pdserve.kernels", "True"]


def test_inside_the_checkout_bare_kernels_is_the_installed_package(tmp_path):
    # With the checkout's root first on sys.path, `import kernels` (transformers does it) must still get
    # the installed package of that name, and model configs must load.
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("OWNER = 'installed'\n")
    result = _python("import kernels, pdserve.kernels; print(kernels.OWNER, pdserve.kernels.__name__)", REPO,
                     PYTHONPATH=os.pathsep.join([str(REPO), str(site)]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["installed", "pdserve.kernels"]
    result = _python("from transformers import LlamaConfig; print(LlamaConfig.model_type)", REPO,
                     PYTHONPATH=str(REPO))
    assert result.returncode == 0 and result.stdout.split() == ["llama"], result.stderr[-2000:]


def test_bare_kernels_without_an_installed_package_names_pdserve_kernels(tmp_path):
    # -S: no site-packages, so nothing else owns the name
    result = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); import kernels"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "ImportError: 'kernels' is not installed" in result.stderr and "pdserve.kernels" in result.stderr


def test_importing_pdserve_alone_loads_no_torch(tmp_path):
    result = _python("import sys, pdserve; print(pdserve.SamplingParams.__module__, 'torch' in sys.modules)",
                     tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pdserve.control.sampling_params", "False"]
