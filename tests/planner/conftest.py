"""Fixtures of the plan tests: a tiny real model directory and a synthetic profile of it."""

from __future__ import annotations

import pytest

from pdserve.planner.profile.fit import model_identity
from tests.planner.helpers import synthetic_profile


@pytest.fixture
def tiny_model(model_factory):
    return model_factory()


@pytest.fixture
def profile_path(tmp_path, tiny_model):
    path = tmp_path / "profile.json"
    path.write_text(synthetic_profile(model_identity(tiny_model)).model_dump_json())
    return str(path)
