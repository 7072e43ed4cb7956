"""The run-time options of a loaded model, in one object built where the command line is read.

Every backend's `load` takes a RunOptions and uses the fields that concern it: the WebGPU ones
mean nothing to the reference or CUDA backends, which ignore them. `from_env` reads the two debug
variables where the command line builds the options (docs/TROUBLESHOOTING.md, "Debug variables");
below it only AIRFRAME_ADAPTER, the choice of adapter, is read, where the device is opened.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .errors import ParameterError

MATMULS = ("auto", "rows", "tiled")
REDUCES = ("auto", "subgroup", "shared")
DEBUG_VARIABLES = {"debug_raw": "SHIMMY_DEBUG_RAW", "trace_prefill_chunks": "AIRFRAME_TRACE_PREFILL_CHUNKS"}


@dataclass(frozen=True)
class RunOptions:
    n_ctx: int | None = None  # K/V cache positions; None: the backend's default
    progress: bool = False  # progress bars while loading
    check_tensors: bool = False  # scan every weight for NaN/inf before loading (airframe/tensor_check.py)
    prefill_chunk: int = 512  # prompt tokens per pass (WebGPU) and per cancel check (every backend)
    prompt_cache: bool = True  # keep the K/V of the prompt prefix a request shares with the one before
    # K/V caches, each keeping one conversation warm; None: the backend's default (airframe serve's)
    slots: int | None = 1
    max_binding: int | None = None  # WebGPU: a lower binding limit than the adapter's (tests of chunked tensors)
    matmul: str = "auto"  # WebGPU: "rows" (gemm_rows.wgsl) or "tiled" (gemv + gemm); auto: rows on CPU adapters
    reduce: str = "auto"  # WebGPU: gemv sums by "subgroup" ops or "shared" memory; auto: subgroup where supported
    debug_raw: bool = False  # WebGPU: one dispatch per submit, statistics of each op's output logged
    trace_prefill_chunks: bool = False  # WebGPU: each prefill chunk's positions and time logged

    def __post_init__(self):
        _check_integer("n_ctx", self.n_ctx, 2, "None (the backend's default)")
        _check_integer("prefill_chunk", self.prefill_chunk, 1)
        _check_integer("slots", self.slots, 1, "None (the backend's default)")
        _check_integer("max_binding", self.max_binding, 1, "None (the adapter's)")
        check_choice("matmul", self.matmul, MATMULS)
        check_choice("reduce", self.reduce, REDUCES)
        for name in ("progress", "check_tensors", "prompt_cache", "debug_raw", "trace_prefill_chunks"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(f"{name} = {getattr(self, name)!r}, expected True or False")

    @classmethod
    def from_env(cls, **overrides) -> "RunOptions":
        """The options a command asks for, with SHIMMY_DEBUG_RAW=1 and AIRFRAME_TRACE_PREFILL_CHUNKS=1
        turning on debug_raw and trace_prefill_chunks; no other variable is read."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ParameterError(f"unknown run options {unknown}; expected {', '.join(names)}")
        from_env = {name: os.environ.get(variable) == "1" for name, variable in DEBUG_VARIABLES.items()}
        return cls(**{**from_env, **overrides})


def _check_integer(name: str, value, least: int, none: str | None = None) -> None:
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        also = f" or {none}" if none is not None else ""
        raise ParameterError(f"{name} = {value!r}, expected an integer >= {least}{also}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ParameterError(f"{name} = {value!r}, expected one of {', '.join(choices)}")
