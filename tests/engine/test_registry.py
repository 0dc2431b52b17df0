"""The model registry: native classes looked up by architecture name, their modules imported only when that
architecture loads, so an engine serving a Llama-family model starts without importing transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.config import ModelConfig
from pdserve.engine.loader import load_model
from pdserve.engine.models.registry import NATIVE_MODELS, is_native, native_model_class


@pytest.mark.parametrize("architecture", sorted(NATIVE_MODELS))
def test_every_native_architecture_names_a_class_of_its_module(architecture):
    model_class = native_model_class(architecture)
    assert (model_class.__name__, model_class.__module__) == (architecture, NATIVE_MODELS[architecture])


def test_a_native_model_is_native_and_the_transformers_backend_is_not(model_factory):
    model_dir = model_factory("llama")
    assert is_native(load_model(ModelConfig.from_hf(model_dir, dtype="float32")))
    assert not is_native(load_model(ModelConfig.from_hf(model_dir, dtype="float32", model_impl="transformers")))


def test_loading_a_llama_model_imports_no_transformers(model_factory):
    code = ("import sys\nfrom pdserve.engine.config import ModelConfig\nfrom pdserve.engine.loader import load_model\n"
            f"load_model(ModelConfig.from_hf({model_factory('llama')!r}, dtype='float32'))\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'transformers'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
