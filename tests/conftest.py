"""Shared fixtures: the real test models, resolved once per test run (pytest session scope)."""

from pathlib import Path

import pytest

from airframe.models import resolve_model


def pytest_addoption(parser):
    parser.addoption("--sampled-tokens", type=int, default=16,
                     help="tokens per setting of the real-model sampled-path checks (the issue's check: 200)")


@pytest.fixture(scope="session")
def sampled_tokens(request) -> int:
    return request.config.getoption("--sampled-tokens")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return resolve_model("gemma3-270m")
