"""What every backend (reference, webgpu, cuda) offers the engine.

A backend holds one model and one K/V cache. `forward` runs tokens at consecutive positions,
appending their K/V to the cache, and returns logits; `reset` empties the cache between requests.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .family import ModelConfig

BACKENDS = ("webgpu", "reference", "cuda")
DEFAULT_BACKEND = "webgpu"


class Backend(Protocol):
    name: str
    config: ModelConfig
    n_ctx: int  # capacity of the K/V cache in positions
    n_past: int  # positions already in the cache

    def reset(self) -> None:
        """Forget every position: the next forward starts at position 0."""

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run `tokens` at positions n_past.. and advance n_past.

        Returns float32 logits of the last position, shape (vocab,), or of every position,
        shape (len(tokens), vocab), when all_logits is set.
        """


def open_backend(name: str, model_path, n_ctx: int | None = None, rope_scaling: str | None = None,
                 rope_scale: float | None = None, **options) -> Backend:
    """Load a model file into the named backend.

    rope_scaling ("none", "linear", "yarn", "llama3") and rope_scale (the context extension factor
    S >= 1) replace the RoPE scaling the file declares; left None, the file's own is used
    (docs/EXTENDED_CONTEXT.md).
    """
    from .errors import ParameterError
    from .rope_scaling import requested, warn_beyond_training

    override = requested(rope_scaling, rope_scale)
    if override is not None:
        if name == "cuda":
            raise ParameterError("the cuda backend takes no rope scaling override; "
                                 "expected rope_scaling=None with --backend cuda")
        options["rope_scaling"] = override

    if name == "reference":
        from .reference import ReferenceBackend

        backend = ReferenceBackend.load(model_path, n_ctx=n_ctx, **options)
    elif name == "webgpu":
        from .gpu.backend import WebGPUBackend

        backend = WebGPUBackend.load(model_path, n_ctx=n_ctx, **options)
    elif name == "cuda":
        from .megakernel.cuda.backend import CudaBackend

        return CudaBackend.load(model_path, n_ctx=n_ctx, **options)  # its context is fixed by its plan
    else:
        raise ParameterError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    warn_beyond_training(backend.config, backend.n_ctx)
    return backend
