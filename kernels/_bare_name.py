"""Hand the bare name `kernels` to the installed package that owns it.

pdserve's source folders sit at the repository root and become `pdserve.<folder>` when installed.
With a checkout's root on sys.path (pytest from the checkout, `python -m` from it, an engine process
started with PYTHONPATH set to it), this folder is also importable as plain `kernels`, which is the
import name of Hugging Face's `kernels` package; transformers >= 5.25 depends on that package and
imports it with the first model config. Such an import lands here and is handed over: the installed
package is loaded from sys.path without the checkout's root and replaces this module in sys.modules
(the import system returns whatever sys.modules holds once the module has run). Standard library
only: pdserve itself may be half imported when this runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _same_folder(entry: str, folder: str) -> bool:
    return os.path.realpath(entry or os.getcwd()) == folder


def hand_over(name: str, init_file: str) -> None:
    """Make sys.modules[name] the installed package `name`; ImportError naming pdserve's if none."""
    checkout_root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    search_path = [entry for entry in sys.path if not _same_folder(entry, checkout_root)]
    spec = importlib.machinery.PathFinder.find_spec(name, search_path)
    if spec is None or spec.loader is None:
        raise ImportError(
            f"'{name}' is not installed; the folder {os.path.dirname(init_file)} is pdserve's source, "
            f"imported as pdserve.{name} (pip install -e . from the checkout)", name=name)
    sys.modules.pop(__name__, None)  # this helper, loaded as a submodule of the bare name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
