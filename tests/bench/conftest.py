"""Fixtures of the bench tests: bench/mock_server.py started once per test module."""

from __future__ import annotations

import pytest

from tests.bench.test_serve_failures import start_fake_server


@pytest.fixture(scope="module")
def fake_url():
    """The URL of a synthetic OpenAI-compatible server (bench/mock_server.py), killed after the module."""
    process, url = start_fake_server()
    yield url
    process.kill()
    process.wait()
