"""Shared fixtures: the real test models, resolved once per test run (pytest session scope)."""

from pathlib import Path

import pytest

from airframe.models import resolve_model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return resolve_model("gemma3-270m")


def pytest_addoption(parser):
    parser.addoption("--server-fuzz-examples", type=int, default=25, metavar="N",
                     help="schemathesis examples per operation in test_server_live.py (default 25, for CI)")
