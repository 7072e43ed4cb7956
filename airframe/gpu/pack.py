"""Weights in GPU memory, still quantized.

WGSL reads storage buffers as 32-bit words, so each GGUF block is re-laid at load time into a whole
number of words (`relayout`): the scale of the blocks whose size is not a multiple of 4 bytes
(Q4_0 18 B, Q5_0 22 B, Q8_0 34 B, Q6_K 210 B) moves into a word of its own, already widened from
f16 to f32 by numpy (exactly the conversion the `gguf` oracle does), and the quant bytes follow
word-aligned in their file order; the other formats keep their bytes. Q6_K's blocks (53 words)
are then laid 4 at a time, their 4 scale words first, so that every block's quants start 16-byte
aligned (`QuantType.group`). The segments of each type are in airframe/quants.py;
docs/QUANTIZATION.md draws every layout.

Each layer's tensors share ONE storage buffer ("bindless", `pack_tensors`): every tensor sits at a
word offset aligned to TENSOR_ALIGN_WORDS, 1-D tensors (norm weights, biases) as float32, and the
shaders find a tensor by the word offset each dispatch's parameters carry. A matrix too large for
one binding (the token embedding and LM head of big vocabularies) is cut by rows into chunks that
each fit one binding (`pack_rows`), spread over several buffers when they exceed the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import wgpu

from ..errors import UnsupportedError
from ..gguf_file import GGUFFile, dequantize_rows
from ..quants import QuantType, quant

TENSOR_ALIGN_WORDS = 64  # 256 bytes: the strictest storage offset alignment WebGPU allows
UPLOAD_BYTES = 64 << 20  # re-lay and upload big tensors in pieces of about this size


# ---- the re-layout of blocks ----------------------------------------------------------------
def _file_blocks(raw: np.ndarray, q: QuantType) -> np.ndarray:
    """(rows, row_bytes) uint8 -> (rows, GPU blocks, bytes of a GPU block in the file), checked."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise UnsupportedError(f"{q.name} tensor bytes: got {raw.dtype} array of shape {raw.shape}, "
                               f"expected a 2-D uint8 array (rows, row_bytes)")
    rows, row_bytes = raw.shape
    if row_bytes % q.gpu_block_file_bytes:
        raise UnsupportedError(f"{q.name} row of {row_bytes} bytes is not a whole number of GPU blocks "
                               f"({q.gpu_block} elements = {q.gpu_block_file_bytes} bytes)")
    return raw.reshape(rows, row_bytes // q.gpu_block_file_bytes, q.gpu_block_file_bytes)


def relayout(raw: np.ndarray, qtype) -> np.ndarray:
    """(rows, row_bytes) uint8 as in the GGUF -> (rows, row_words) uint32 as the shaders read it."""
    q = quant(qtype)
    blocks = _file_blocks(raw, q)
    rows = blocks.shape[0]
    if len(q.segments) == 1:  # already aligned: the bytes are the words
        return np.ascontiguousarray(raw).view("<u4").reshape(rows, -1)
    parts = []
    for first, end, widen in q.segments:
        part = blocks[..., first:end]
        if widen:
            part = np.ascontiguousarray(part).view("<f2").astype("<f4").view(np.uint8)
        parts.append(part)
    laid = np.concatenate(parts, axis=-1).view("<u4")  # (rows, blocks, gpu_words)
    return _grouped(laid, q.group) if q.group > 1 else laid.reshape(rows, -1)


def _grouped(laid: np.ndarray, group: int) -> np.ndarray:
    """(rows, blocks, words) -> (rows, row_words): each `group` blocks as their first words, then the
    rest of each; the last, shorter group's first words padded to `group` with zeros."""
    rows, n, _ = laid.shape
    pieces = []
    for first in range(0, n, group):
        g = laid[:, first:first + group]
        pad = np.zeros((rows, group - g.shape[1]), dtype=laid.dtype)
        pieces += [g[:, :, 0], pad, g[:, :, 1:].reshape(rows, -1)]
    return np.concatenate(pieces, axis=1)


def _ungrouped(words: np.ndarray, q: QuantType) -> np.ndarray:
    """The inverse of `_grouped`: (rows, row_words) -> (rows, blocks, gpu_words)."""
    rows, n = words.shape[0], words.shape[1] // q.gpu_words  # the padding is under one block
    out = np.empty((rows, n, q.gpu_words), dtype=words.dtype)
    at = 0
    for first in range(0, n, q.group):
        size = min(q.group, n - first)
        out[:, first:first + size, 0] = words[:, at:at + size]
        at += q.group
        out[:, first:first + size, 1:] = words[:, at:at + size * (q.gpu_words - 1)].reshape(rows, size, -1)
        at += size * (q.gpu_words - 1)
    return out


def restore(words: np.ndarray, qtype) -> np.ndarray:
    """The inverse of `relayout`: (rows, row_words) uint32 -> the GGUF bytes (rows, row_bytes)."""
    q = quant(qtype)
    words = np.ascontiguousarray(words, dtype="<u4")
    rows = words.shape[0]
    if q.group > 1:
        words = _ungrouped(words, q)
    laid = words.view(np.uint8).reshape(rows, -1, q.gpu_words * 4)
    out = np.empty((rows, laid.shape[1], q.gpu_block_file_bytes), dtype=np.uint8)
    at = 0
    for first, end, widen in q.segments:
        width = 4 if widen else end - first
        part = laid[..., at:at + width]
        if widen:
            part = np.ascontiguousarray(part).view("<f4").astype("<f2").view(np.uint8)
        out[..., first:end] = part
        at += width
    return out.reshape(rows, -1)


# ---- one layer's tensors in one buffer ------------------------------------------------------
@dataclass(frozen=True)
class PackedTensor:
    """One tensor inside a layer buffer. Matrices are (rows, cols) with row_words words per row."""

    name: str
    qtype: object
    quant: QuantType | None  # None for a 1-D float32 vector
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
            q, rows, cols, row_words = None, 1, t.shape[0], t.shape[0]
        else:
            q = quant(t.qtype)
            rows, cols = t.n_rows, t.shape[0]
            if cols % q.gpu_block:
                raise UnsupportedError(f"{gf.path}: tensor {name!r} has rows of {cols} elements, "
                                       f"expected a multiple of the {q.name} block of {q.gpu_block}")
            row_words = q.gpu_row_words(cols)
        placed[name] = PackedTensor(name, t.qtype, q, rows, cols, row_words, at)
        at += -(-rows * row_words // TENSOR_ALIGN_WORDS) * TENSOR_ALIGN_WORDS
    return placed, at


def pack_tensors(ctx, gf: GGUFFile, names: list[str], label: str) -> LayerPack:
    """Put the named tensors (GGUF names) into one new storage buffer."""
    placed, n_words = _layout(gf, names)
    if n_words * 4 > ctx.max_binding:
        raise UnsupportedError(f"{gf.path}: {label} needs {n_words * 4:,} bytes in one binding, "
                               f"the adapter binds at most {ctx.max_binding:,}")
    buffer = ctx.device.create_buffer(label=label, size=max(n_words * 4, 16),
                                      usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST)
    for name, p in placed.items():
        ctx.device.queue.write_buffer(buffer, p.offset * 4, np.ascontiguousarray(_words_for(gf, name)))
    return LayerPack(buffer, n_words, placed)


# ---- a matrix in row chunks -----------------------------------------------------------------
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
    quant: QuantType
    rows: int
    cols: int
    row_words: int
    chunks: list[RowChunk]

    def chunks_of(self, first: int, count: int) -> list[tuple[RowChunk, int, int]]:
        """(chunk, first row inside it, rows) of each chunk that rows [first, first + count) touch."""
        out = []
        for c in self.chunks:
            lo, hi = max(first, c.first_row), min(first + count, c.first_row + c.n_rows)
            if lo < hi:
                out.append((c, lo - c.first_row, hi - lo))
        return out


def plan_row_chunks(rows: int, row_bytes: int, max_binding: int, max_buffer: int,
                    alignment: int) -> list[tuple[int, int, int, int]]:
    """(buffer index, byte offset, first row, row count) of each chunk: as many rows as one binding
    holds, each chunk at the next multiple of `alignment` in its buffer, a new buffer when the
    next chunk would pass the largest buffer."""
    per_chunk = min(max_binding, max_buffer) // row_bytes
    if per_chunk < 1:
        raise UnsupportedError(f"a row of {row_bytes:,} bytes does not fit one binding of {max_binding:,} bytes")
    plan, index, at = [], 0, 0
    for first in range(0, rows, per_chunk):
        n = min(per_chunk, rows - first)
        if at + n * row_bytes > max_buffer:
            index, at = index + 1, 0
        plan.append((index, at, first, n))
        at = -(-(at + n * row_bytes) // alignment) * alignment
    return plan


def upload_rows(ctx, name: str, qtype, rows: int, cols: int, read: Callable[[int, int], np.ndarray],
                max_binding: int | None = None, usage: int = 0) -> ChunkedTensor:
    """A (rows, cols) matrix in row chunks that each fit one binding; `read(first, count)` gives
    the re-laid words of rows [first, first + count)."""
    q = quant(qtype)
    row_words = q.gpu_row_words(cols)
    row_bytes = row_words * 4
    plan = plan_row_chunks(rows, row_bytes, max_binding or ctx.max_binding, ctx.max_buffer,
                           max(ctx.offset_alignment, 4))
    buffers: dict[int, object] = {}
    for index in sorted({p[0] for p in plan}):
        last = max(off + n * row_bytes for i, off, _, n in plan if i == index)
        buffers[index] = ctx.device.create_buffer(label=f"{name}#{index}", size=last,
                                                  usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | usage)
    chunks = []
    piece = max(1, UPLOAD_BYTES // row_bytes)
    for index, offset, first, n in plan:
        buffer = buffers[index]
        for start in range(first, first + n, piece):
            count = min(piece, first + n - start)
            words = np.ascontiguousarray(read(start, count))
            ctx.device.queue.write_buffer(buffer, offset + (start - first) * row_bytes, words)
        chunks.append(RowChunk(buffer, offset, n * row_bytes, first, n))
    return ChunkedTensor(name, q.qtype, q, rows, cols, row_words, chunks)


def pack_rows(ctx, gf: GGUFFile, name: str, max_binding: int | None = None) -> ChunkedTensor:
    """A matrix of the file in row chunks (the token embedding, the LM head)."""
    t = gf.tensor(name)
    return upload_rows(ctx, name, t.qtype, t.n_rows, t.shape[0],
                       lambda first, count: _words_for(gf, name, first, count), max_binding)
