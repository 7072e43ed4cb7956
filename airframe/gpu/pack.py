"""Weights in GPU memory, still quantized.

Each layer's tensors share ONE storage buffer ("bindless"): every tensor is re-laid out by
`quant_layout.relayout` into 4-byte-aligned blocks and placed at a word offset aligned to
TENSOR_ALIGN_WORDS; 1-D tensors (norm weights) are stored as float32. The shaders find a tensor by
its word offset, which the runtime writes into each dispatch's parameter slot. Tensors too large for
one binding (the token embedding / LM head of big vocabularies) are split by rows into chunks, each
bound on its own at an aligned offset, spread over several buffers when they exceed the largest
buffer. docs/ARCHITECTURE.md draws the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import UnsupportedError
from ..gguf_file import GGUFFile, dequantize_rows
from .quant_layout import GpuQuant, gpu_quant, relayout

TENSOR_ALIGN_WORDS = 64  # 256 bytes: the strictest storage offset alignment WebGPU allows
UPLOAD_ROWS_BYTES = 64 << 20  # re-lay and upload big tensors in pieces of about this size


@dataclass(frozen=True)
class PackedTensor:
    """One tensor inside a layer buffer. Matrices are (rows, cols) with row_words words per row."""

    name: str
    qtype: object
    quant: GpuQuant | None  # None for a 1-D float32 vector
    rows: int
    cols: int
    row_words: int
    offset: int  # word offset inside the buffer


@dataclass
class LayerPack:
    """A group of tensors (one layer, or the small global ones) in one storage buffer."""

    buffer: object
    n_words: int
    tensors: dict[str, PackedTensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> PackedTensor:
        return self.tensors[name]


@dataclass(frozen=True)
class RowChunk:
    """Rows [first_row, first_row + n_rows) of a tensor, bound alone: `size` bytes at `offset`."""

    buffer: object
    offset: int
    size: int
    first_row: int
    n_rows: int


@dataclass
class ChunkedTensor:
    name: str
    qtype: object
    quant: GpuQuant
    rows: int
    cols: int
    row_words: int
    chunks: list[RowChunk]


def _words_for(gf: GGUFFile, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
    """(rows, row_words) uint32 of the tensor's rows, re-laid for the shaders."""
    t = gf.tensor(name)
    count = t.n_rows - first if count is None else count
    raw = gf.raw_rows(name, first, count)
    if len(t.shape) == 1:  # norm weights and other vectors: plain float32
        return dequantize_rows(raw, t.qtype).astype(np.float32).view(np.uint32)
    return relayout(raw, t.qtype)


def _layout(gf: GGUFFile, names: list[str]) -> tuple[dict[str, PackedTensor], int]:
    placed = {}
    at = 0
    for name in names:
        t = gf.tensor(name)
        if len(t.shape) == 1:
            quant, rows, cols, row_words = None, 1, t.shape[0], t.shape[0]
        else:
            quant = gpu_quant(t.qtype)
            rows, cols = t.n_rows, t.shape[0]
            if cols % quant.block_elems:
                raise UnsupportedError(f"{gf.path}: tensor {name!r} has rows of {cols} elements, "
                                       f"expected a multiple of the {t.qtype.name} block of {quant.block_elems}")
            row_words = cols // quant.block_elems * quant.block_words
        placed[name] = PackedTensor(name, t.qtype, quant, rows, cols, row_words, at)
        at += -(-rows * row_words // TENSOR_ALIGN_WORDS) * TENSOR_ALIGN_WORDS
    return placed, at


def pack_tensors(ctx, gf: GGUFFile, names: list[str], label: str) -> LayerPack:
    """Put the named tensors (GGUF names) into one new storage buffer."""
    import wgpu

    placed, n_words = _layout(gf, names)
    if n_words * 4 > ctx.max_binding:
        raise UnsupportedError(f"{gf.path}: {label} needs {n_words * 4:,} bytes in one binding, "
                               f"the adapter binds at most {ctx.max_binding:,}")
    buffer = ctx.device.create_buffer(label=label, size=max(n_words * 4, 16),
                                      usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST)
    for name, p in placed.items():
        ctx.device.queue.write_buffer(buffer, p.offset * 4, np.ascontiguousarray(_words_for(gf, name)))
    return LayerPack(buffer, n_words, placed)


def plan_row_chunks(rows: int, row_bytes: int, max_binding: int, max_buffer: int,
                    alignment: int) -> list[tuple[int, int, int, int]]:
    """(buffer index, byte offset, first row, row count) of each chunk.

    Every chunk is at most max_binding bytes and starts at a multiple of `alignment` (rows per chunk
    are a multiple of alignment / gcd(row_bytes, alignment)); buffers hold whole chunks.
    """
    step = alignment // np.gcd(row_bytes, alignment)
    per_chunk = max_binding // row_bytes // step * step
    if per_chunk < 1:
        raise UnsupportedError(f"a row of {row_bytes:,} bytes does not fit one binding of {max_binding:,} bytes "
                               f"at alignment {alignment}")
    per_buffer = max(1, max_buffer // (per_chunk * row_bytes)) * per_chunk
    plan = []
    for first in range(0, rows, per_chunk):
        n = min(per_chunk, rows - first)
        plan.append((first // per_buffer, (first % per_buffer) * row_bytes, first, n))
    return plan


def pack_rows(ctx, gf: GGUFFile, name: str, max_binding: int | None = None) -> ChunkedTensor:
    """A matrix in row chunks that each fit one binding (the token embedding, the LM head)."""
    import wgpu

    t = gf.tensor(name)
    quant = gpu_quant(t.qtype)
    rows, cols = t.n_rows, t.shape[0]
    row_words = cols // quant.block_elems * quant.block_words
    row_bytes = row_words * 4
    plan = plan_row_chunks(rows, row_bytes, max_binding or ctx.max_binding, ctx.max_buffer,
                           max(ctx.offset_alignment, 4))
    buffers: dict[int, object] = {}
    for index in sorted({p[0] for p in plan}):
        last = max(off + n * row_bytes for i, off, _, n in plan if i == index)
        buffers[index] = ctx.device.create_buffer(label=f"{name}#{index}", size=last,
                                                  usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST)
    chunks = []
    piece = max(1, UPLOAD_ROWS_BYTES // row_bytes)
    for index, offset, first, n in plan:
        buffer = buffers[index]
        for start in range(first, first + n, piece):
            count = min(piece, first + n - start)
            words = np.ascontiguousarray(_words_for(gf, name, start, count))
            ctx.device.queue.write_buffer(buffer, offset + (start - first) * row_bytes, words)
        chunks.append(RowChunk(buffer, offset, n * row_bytes, first, n))
    return ChunkedTensor(name, t.qtype, quant, rows, cols, row_words, chunks)
