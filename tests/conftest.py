"""Shared fixtures: the real test models, resolved once per test run (pytest session scope).

scripts/install.sh pulls the models every run needs. Tests marked `large_model` need one it does
not pull (qwen2.5-coder-1.5b, 1.1 GB): they run with --large-models and are reported as skipped,
with the command that runs them, otherwise.
"""

from pathlib import Path

import pytest

from airframe.models import resolve_model

LARGE_MODELS = ("qwen2.5-coder-1.5b",)


def pytest_addoption(parser):
    parser.addoption("--sampled-tokens", type=int, default=8,
                     help="tokens per setting of the real-model sampled-path checks (the issue's check: 200)")
    parser.addoption("--large-models", action="store_true",
                     help=f"also run the tests of {', '.join(LARGE_MODELS)} (`airframe pull` it first)")
    _server_options(parser)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--large-models"):
        return
    skip = pytest.mark.skip(reason=f"needs {', '.join(LARGE_MODELS)}: `airframe pull {' '.join(LARGE_MODELS)}`, "
                                   f"then pytest --large-models")
    for item in items:
        if "large_model" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sampled_tokens(request) -> int:
    return request.config.getoption("--sampled-tokens")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return resolve_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    return resolve_model("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def nan_model_path(tmp_path_factory) -> Path:
    """A tiny synthetic llama (SmolLM2's tokenizer and chat template) with one NaN in its first
    attention norm: every logit it computes is NaN."""
    from airframe.synthetic import plant_nan, write_synthetic_gguf

    return plant_nan(write_synthetic_gguf(tmp_path_factory.mktemp("nan") / "nan.gguf", "llama", "tiny", "F32"))


def _server_options(parser):
    parser.addoption("--server-fuzz-examples", type=int, default=25, metavar="N",
                     help="schemathesis examples per operation in test_server_live.py (default 25, for CI)")
    _fuzz_options(parser)


def _fuzz_options(parser):
    parser.addoption("--fuzz-long", action="store_true",
                     help="tests/test_gguf_fuzz.py: 10,000 mutants of every base model instead of CI's few")
    parser.addoption("--fuzz-workers", type=int, default=2, help="tests/test_gguf_fuzz.py: worker processes")
    parser.addoption("--fuzz-first", type=int, default=0,
                     help="tests/test_gguf_fuzz.py: start at this case number (to split a long run)")
