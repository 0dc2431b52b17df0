"""A CPU install stays light: `pip install -e .` resolves no triton (it is the `triton` extra, which `dev` and
so CI include, and which torch's CUDA wheels bring anyway), and a process that needs the Triton kernels without
it is told how to get them."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from pdserve.engine.attention import selector
from pdserve.engine.config import ConfigError

PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {Requirement(text).name.lower() for text in requirements}


def test_the_base_install_resolves_no_triton():
    assert "triton" not in names(PROJECT["dependencies"])
    assert "torch" in names(PROJECT["dependencies"])


def test_the_triton_and_dev_extras_bring_it():
    extras = PROJECT["optional-dependencies"]
    assert "triton" in names(extras["triton"])
    assert "triton" in names(extras["dev"]), "CI (the dev extra) runs the kernel tests under the interpreter"


def test_triton_kernels_without_triton_name_the_extra(monkeypatch):
    monkeypatch.setattr(selector.kernels, "kernel_backend", lambda device: "triton")
    monkeypatch.setattr(selector.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install 'pdserve\[triton\]'.*PDSERVE_KERNELS=torch"):
        selector.get_attn_backend(torch.device("cpu"), 16)
