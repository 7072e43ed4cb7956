"""RunOptions: each option checked with its allowed values, and the two debug variables of from_env."""

import pytest

from airframe.errors import ParameterError
from airframe.options import RunOptions


def test_defaults():
    options = RunOptions()
    assert (options.n_ctx, options.progress, options.prefill_chunk, options.max_binding) == (None, False, 512, None)
    assert (options.matmul, options.reduce, options.debug_raw, options.trace_prefill_chunks) == (
        "auto", "auto", False, False)


@pytest.mark.parametrize("field,value,message", [
    ("n_ctx", 1, "n_ctx = 1, expected an integer >= 2 or None"),
    ("n_ctx", 2.5, "n_ctx = 2.5, expected an integer >= 2"),
    ("n_ctx", True, "n_ctx = True, expected an integer >= 2"),
    ("prefill_chunk", 0, "prefill_chunk = 0, expected an integer >= 1"),
    ("max_binding", -4, "max_binding = -4, expected an integer >= 1 or None"),
    ("matmul", "fast", "matmul = 'fast', expected one of auto, rows, tiled"),
    ("reduce", "warp", "reduce = 'warp', expected one of auto, subgroup, shared"),
    ("progress", "yes", "progress = 'yes', expected True or False"),
    ("debug_raw", 1, "debug_raw = 1, expected True or False"),
])
def test_bad_values_name_the_allowed_ones(field, value, message):
    with pytest.raises(ParameterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunOptions(**{field: value})


def test_from_env_reads_the_two_debug_variables(monkeypatch):
    for variable in ("SHIMMY_DEBUG_RAW", "AIRFRAME_TRACE_PREFILL_CHUNKS", "AIRFRAME_MATMUL", "AIRFRAME_REDUCE"):
        monkeypatch.delenv(variable, raising=False)
    assert RunOptions.from_env(n_ctx=64) == RunOptions(n_ctx=64)
    monkeypatch.setenv("SHIMMY_DEBUG_RAW", "1")
    assert RunOptions.from_env() == RunOptions(debug_raw=True)
    monkeypatch.setenv("AIRFRAME_TRACE_PREFILL_CHUNKS", "1")
    monkeypatch.setenv("AIRFRAME_MATMUL", "tiled")  # not an option of RunOptions: the environment is not read for it
    monkeypatch.setenv("AIRFRAME_REDUCE", "shared")
    assert RunOptions.from_env(progress=True) == RunOptions(progress=True, debug_raw=True, trace_prefill_chunks=True)
    assert RunOptions.from_env(debug_raw=False).debug_raw is False  # what the caller asks for wins


def test_from_env_names_an_unknown_option():
    with pytest.raises(ParameterError, match=r"unknown run options \['speed'\]; expected n_ctx, progress"):
        RunOptions.from_env(speed=2)
