"""Tests of the scripts under experiments/ (not installed), each loaded from its file as `python experiments/X.py`
runs it: with experiments/ first on sys.path, so that a script's sibling imports resolve."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_experiment(name: str) -> ModuleType:
    """experiments/<name>.py as a module."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    return importlib.import_module(name)
