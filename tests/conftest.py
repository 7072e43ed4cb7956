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
    parser.addoption("--fuzz-long", action="store_true",
                     help="tests/test_gguf_fuzz.py: 10,000 mutants of every base model instead of CI's few")
    parser.addoption("--fuzz-workers", type=int, default=2, help="tests/test_gguf_fuzz.py: worker processes")
    parser.addoption("--fuzz-first", type=int, default=0,
                     help="tests/test_gguf_fuzz.py: start at this case number (to split a long run)")
