"""Dequantize rows of a re-laid tensor on the GPU (`shaders/dequant.wgsl`).

This is the GPU side that `quant-verify` and the tests compare with the `gguf` package's numpy
dequantization: it runs the very decoder files (`shaders/quant/<type>.wgsl`) the matmul kernels
include. A tensor is uploaded in row chunks that each fit one binding, as the runtime packs the
LM head (pack.upload_rows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import wgpu

from ..errors import GPUError
from ..quants import quant
from .device import GPUContext, get_context
from .pack import ChunkedTensor, relayout, upload_rows
from .shaders import load_wgsl

WORKGROUP = 64
MAX_OUT_BYTES = 32 << 20  # f32 values read back per dispatch: bounds host memory, not correctness


def upload(raw: np.ndarray, qtype, ctx: GPUContext | None = None, max_binding: int | None = None) -> ChunkedTensor:
    """(rows, row_bytes) uint8 as in the GGUF -> a re-laid tensor on the GPU; `max_binding` lowers
    the binding limit so that small tensors are chunked too (tests)."""
    ctx = ctx or get_context()
    q = quant(qtype)
    words = relayout(raw, q.qtype)
    if words.nbytes > ctx.max_buffer:
        raise GPUError(f"{q.name} tensor of {words.nbytes:,} bytes after re-layout exceeds the "
                       f"adapter's largest buffer of {ctx.max_buffer:,} bytes")
    n_cols = words.shape[1] // q.gpu_words * q.gpu_block
    return upload_rows(ctx, "dequant", q.qtype, words.shape[0], n_cols,
                       lambda first, count: words[first:first + count], max_binding)


_PIPELINES: dict[tuple, object] = {}


def _pipeline(ctx: GPUContext, qtype, decoder: Path | None):
    key = (id(ctx.device), qtype, str(decoder))
    if key not in _PIPELINES:
        include = str(decoder) if decoder else f"quant/{quant(qtype).shader}.wgsl"
        source = load_wgsl("dequant.wgsl", {"DECODER": include})
        module = ctx.device.create_shader_module(code=source)
        _PIPELINES[key] = ctx.device.create_compute_pipeline(
            layout="auto", compute={"module": module, "entry_point": "main"})
    return _PIPELINES[key]


def _grid(n_quads: int, max_per_dim: int) -> tuple[int, int]:
    groups = -(-n_quads // WORKGROUP)
    x = min(groups, max_per_dim)
    return x, -(-groups // x)


def dequantize(tensor: ChunkedTensor, first: int = 0, count: int | None = None, *,
               decoder: Path | None = None, ctx: GPUContext | None = None) -> np.ndarray:
    """Rows [first, first + count) as float32 (count, cols), decoded on the GPU.

    `decoder` replaces `shaders/quant/<type>.wgsl` by another file (tests use a broken one).
    """
    ctx = ctx or get_context()
    count = tensor.rows - first if count is None else count
    if first < 0 or count < 0 or first + count > tensor.rows:
        raise ValueError(f"rows {first}..{first + count} of a tensor with {tensor.rows} rows")
    out_rows = max(1, min(ctx.max_binding, MAX_OUT_BYTES) // (tensor.cols * 4))
    result = np.empty((count, tensor.cols), dtype=np.float32)
    for chunk, inside, n_rows in tensor.chunks_of(first, count):
        for start in range(0, n_rows, out_rows):
            n = min(out_rows, n_rows - start)
            row = chunk.first_row + inside + start
            result[row - first:row - first + n] = _run(ctx, tensor, chunk, (inside + start) * tensor.row_words,
                                                       n, decoder)
    return result


def _run(ctx: GPUContext, tensor: ChunkedTensor, chunk, first_word: int, n_rows: int, decoder) -> np.ndarray:
    device = ctx.device
    n_quads = n_rows * tensor.cols // 4
    out = device.create_buffer(size=n_quads * 16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    params = np.array([first_word, n_quads, tensor.row_words, tensor.cols // tensor.quant.gpu_block], dtype=np.uint32)
    uniform = device.create_buffer_with_data(data=params, usage=wgpu.BufferUsage.UNIFORM)
    pipeline = _pipeline(ctx, tensor.qtype, decoder)
    bind_group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": chunk.buffer, "offset": chunk.offset, "size": chunk.size}},
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
    return values.reshape(n_rows, tensor.cols)
