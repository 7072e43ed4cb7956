"""A model file opened once: its path, its parsed GGUF and its family config.

The engine, every backend and the perplexity command take a `Model`, so the GGUF is parsed once
however many parts read it (tokenizer, chat template, weights). Known model names and their
download live in models.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .family import ModelConfig, load_config
from .gguf_file import GGUFFile
from .models import resolve_model
from .rope_scaling import RopeScaling, requested


@dataclass(frozen=True)
class Model:
    path: Path
    gguf: GGUFFile
    config: ModelConfig  # the family config, rope_override applied
    rope_override: RopeScaling | None = None  # the user's RoPE scaling instead of the file's; None: the file's


def open_model(model: str | Path, rope_scaling: str | None = None, rope_scale: float | None = None) -> Model:
    """Resolve a path or a known name, parse its GGUF and load its config.

    rope_scaling ("none", "linear", "yarn", "llama3") and rope_scale (the context extension factor
    S >= 1) replace the RoPE scaling the file declares; left None, the file's own is used
    (docs/EXTENDED_CONTEXT.md).
    """
    override = requested(rope_scaling, rope_scale)  # a bad request fails before the file is read
    path = resolve_model(model)
    gguf = GGUFFile(path)
    try:
        return Model(path, gguf, load_config(gguf, override), override)
    except BaseException:
        gguf.close()
        raise
