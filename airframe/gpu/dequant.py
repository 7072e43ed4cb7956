"""Dequantize rows of a re-laid tensor on the GPU (`shaders/dequant.wgsl`).

This is the GPU side that `quant-verify` and the tests compare with the `gguf` package's numpy
dequantization: it runs the very decoder files (`shaders/quant/<type>.wgsl`) the matmul kernels
include. Tensors larger than one storage binding are bound window by window (`chunks.row_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GPUError
from .chunks import row_chunks
from .device import GPUContext, get_context
from .quant_layout import gpu_quant, relayout
from .shaders import load_wgsl

WORKGROUP = 64
MAX_OUT_BYTES = 32 << 20  # f32 values read back per dispatch: bounds host memory, not correctness


@dataclass
class GpuTensor:
    """A re-laid tensor in one GPU storage buffer: rows of `row_words` words, back to back."""

    buffer: object
    qtype: object
    n_rows: int
    n_cols: int
    row_words: int


def upload(raw: np.ndarray, qtype, ctx: GPUContext | None = None) -> GpuTensor:
    """(rows, row_bytes) uint8 as in the GGUF -> a re-laid GPU buffer."""
    import wgpu

    ctx = ctx or get_context()
    q = gpu_quant(qtype)
    words = relayout(raw, q.qtype)
    if words.nbytes > ctx.max_buffer:
        raise GPUError(f"{q.qtype.name} tensor of {words.nbytes:,} bytes after re-layout exceeds the "
                       f"adapter's largest buffer of {ctx.max_buffer:,} bytes")
    buffer = ctx.device.create_buffer_with_data(data=words, usage=wgpu.BufferUsage.STORAGE)
    n_cols = words.shape[1] // q.block_words * q.block_elems
    return GpuTensor(buffer, q.qtype, words.shape[0], n_cols, words.shape[1])


_PIPELINES: dict[tuple, object] = {}


def _pipeline(ctx: GPUContext, qtype, decoder: Path | None):
    key = (id(ctx.device), qtype, str(decoder))
    if key not in _PIPELINES:
        include = str(decoder) if decoder else f"quant/{gpu_quant(qtype).shader}"
        source = load_wgsl("dequant.wgsl", {"DECODER": include})
        module = ctx.device.create_shader_module(code=source)
        _PIPELINES[key] = ctx.device.create_compute_pipeline(
            layout="auto", compute={"module": module, "entry_point": "main"})
    return _PIPELINES[key]


def _grid(n_quads: int, max_per_dim: int) -> tuple[int, int]:
    groups = -(-n_quads // WORKGROUP)
    x = min(groups, max_per_dim)
    return x, -(-groups // x)


def dequantize(tensor: GpuTensor, first: int = 0, count: int | None = None, *,
               decoder: Path | None = None, max_binding: int | None = None,
               ctx: GPUContext | None = None) -> np.ndarray:
    """Rows [first, first + count) as float32 (count, n_cols), decoded on the GPU.

    `decoder` replaces `shaders/quant/<type>.wgsl` by another file (tests use a broken one);
    `max_binding` lowers the binding limit to exercise the windows on small tensors.
    """
    ctx = ctx or get_context()
    count = tensor.n_rows - first if count is None else count
    if first < 0 or count < 0 or first + count > tensor.n_rows:
        raise ValueError(f"rows {first}..{first + count} of a tensor with {tensor.n_rows} rows")
    row_bytes = tensor.row_words * 4
    out_row_bytes = tensor.n_cols * 4
    binding = min(max_binding or ctx.max_binding, ctx.max_binding)
    out_rows = max(1, min(binding, MAX_OUT_BYTES) // out_row_bytes)
    result = np.empty((count, tensor.n_cols), dtype=np.float32)
    for window in row_chunks(first, count, row_bytes, binding, ctx.offset_alignment):
        for start in range(0, window.n_rows, out_rows):
            n = min(out_rows, window.n_rows - start)
            word = (window.skip + start * row_bytes) // 4
            row = window.first_row + start - first
            result[row:row + n] = _run(ctx, tensor, window, word, n, decoder)
    return result


def _run(ctx: GPUContext, tensor: GpuTensor, window, first_word: int, n_rows: int, decoder) -> np.ndarray:
    import wgpu

    device = ctx.device
    n_quads = n_rows * tensor.n_cols // 4
    out = device.create_buffer(size=n_quads * 16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    params = np.array([first_word, n_quads, 0, 0], dtype=np.uint32)
    uniform = device.create_buffer_with_data(data=params, usage=wgpu.BufferUsage.UNIFORM)
    pipeline = _pipeline(ctx, tensor.qtype, decoder)
    bind_group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": tensor.buffer, "offset": window.offset, "size": window.size}},
        {"binding": 1, "resource": {"buffer": out}},
        {"binding": 2, "resource": {"buffer": uniform}},
    ])
    encoder = device.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.set_pipeline(pipeline)
    compute.set_bind_group(0, bind_group)
    compute.dispatch_workgroups(*_grid(n_quads, int(ctx.limits["max-compute-workgroups-per-dimension"])))
    compute.end()
    device.queue.submit([encoder.finish()])
    values = np.frombuffer(device.queue.read_buffer(out), dtype=np.float32)
    out.destroy()
    return values.reshape(n_rows, tensor.n_cols)
