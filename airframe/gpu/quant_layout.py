"""How quantized weights are laid out in GPU memory, and the re-layout from the GGUF bytes.

Weights stay quantized on the GPU. WGSL reads storage buffers as 32-bit words, so each GGUF block
is re-laid at load time into a whole number of words: the scale of the blocks whose size is not a
multiple of 4 bytes (Q4_0 18 B, Q5_0 22 B, Q8_0 34 B, Q6_K 210 B) moves into a word of its own,
already widened from f16 to f32 by numpy (exactly the conversion the `gguf` oracle does), and the
quant bytes follow word-aligned in their file order. The other formats keep their bytes as they are.
Each format's decoder is `shaders/quant/<type>.wgsl` (`dq4(blk, i)`); docs/QUANTIZATION.md draws
every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import UnsupportedError

T = GGMLQuantizationType
F32, F16, BF16 = T.F32, T.F16, T.BF16
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0
Q4_K, Q5_K, Q6_K = T.Q4_K, T.Q5_K, T.Q6_K

SUPPORTED = (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)

# A segment is (first byte, end byte, widen) of one GGUF block; widen = an f16 that becomes an f32.
Segment = tuple[int, int, bool]


@dataclass(frozen=True)
class GpuQuant:
    qtype: GGMLQuantizationType
    block_elems: int  # elements per block on the GPU (QK in the shader)
    block_words: int  # u32 words per re-laid block (BLOCK_WORDS in the shader)
    shader: str  # file name under shaders/quant/
    # the re-laid block, in order, as pieces of the GGUF block (of block_elems elements)
    segments: tuple[Segment, ...] = field(repr=False, default=())

    @property
    def file_block_bytes(self) -> int:
        """Bytes of `block_elems` elements in the GGUF file."""
        ggml_block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.block_elems // ggml_block * type_size


def _copy(first: int, end: int) -> Segment:
    return (first, end, False)


def _widen(first: int) -> Segment:
    return (first, first + 2, True)


_TABLE = {
    q.qtype: q for q in (
        # float formats: blocks of 4 elements, stored as in the file
        GpuQuant(F32, 4, 4, "f32.wgsl", (_copy(0, 16),)),
        GpuQuant(F16, 4, 2, "f16.wgsl", (_copy(0, 8),)),
        GpuQuant(BF16, 4, 2, "bf16.wgsl", (_copy(0, 8),)),
        # d f16 | 16 B nibbles  ->  d f32 | 4 words
        GpuQuant(Q4_0, 32, 5, "q4_0.wgsl", (_widen(0), _copy(2, 18))),
        # d f16, m f16 | 16 B nibbles: already aligned
        GpuQuant(Q4_1, 32, 5, "q4_1.wgsl", (_copy(0, 20),)),
        # d f16 | qh 4 B | 16 B nibbles  ->  d f32 | qh | 4 words
        GpuQuant(Q5_0, 32, 6, "q5_0.wgsl", (_widen(0), _copy(2, 22))),
        # d f16, m f16 | qh 4 B | 16 B nibbles: already aligned
        GpuQuant(Q5_1, 32, 6, "q5_1.wgsl", (_copy(0, 24),)),
        # d f16 | 32 int8  ->  d f32 | 8 words
        GpuQuant(Q8_0, 32, 9, "q8_0.wgsl", (_widen(0), _copy(2, 34))),
        # d, dmin f16 | 12 B packed 6-bit scales and mins | 128 B nibbles: already aligned
        GpuQuant(Q4_K, 256, 36, "q4_k.wgsl", (_copy(0, 144),)),
        # d, dmin f16 | 12 B scales | qh 32 B | 128 B nibbles: already aligned
        GpuQuant(Q5_K, 256, 44, "q5_k.wgsl", (_copy(0, 176),)),
        # ql 128 B | qh 64 B | 16 int8 scales | d f16  ->  d f32 | ql | qh | scales
        GpuQuant(Q6_K, 256, 53, "q6_k.wgsl", (_widen(208), _copy(0, 208))),
    )
}


def gpu_quant(qtype) -> GpuQuant:
    """The GPU layout of a quant type; UnsupportedError for a type without a GPU decoder."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedError(f"quant type id {qtype!r} is not a ggml type; expected one of "
                               f"{', '.join(t.name for t in SUPPORTED)}") from None
    if qtype not in _TABLE:
        raise UnsupportedError(f"quant type {qtype.name} has no GPU decoder; expected one of "
                               f"{', '.join(t.name for t in SUPPORTED)}")
    return _TABLE[qtype]


def _file_blocks(raw: np.ndarray, q: GpuQuant) -> np.ndarray:
    """(rows, row_bytes) uint8 -> (rows, blocks, file_block_bytes), checking the shape."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise UnsupportedError(f"{q.qtype.name} tensor bytes: got {raw.dtype} array of shape {raw.shape}, "
                               f"expected a 2-D uint8 array (rows, row_bytes)")
    rows, row_bytes = raw.shape
    if row_bytes % q.file_block_bytes:
        raise UnsupportedError(f"{q.qtype.name} row of {row_bytes} bytes is not a whole number of GPU blocks "
                               f"({q.block_elems} elements = {q.file_block_bytes} bytes)")
    return raw.reshape(rows, row_bytes // q.file_block_bytes, q.file_block_bytes)


def relayout(raw: np.ndarray, qtype) -> np.ndarray:
    """(rows, row_bytes) uint8 as in the GGUF -> (rows, row_words) uint32 as the shaders read it."""
    q = gpu_quant(qtype)
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
    return np.concatenate(parts, axis=-1).view("<u4").reshape(rows, -1)


def restore(words: np.ndarray, qtype) -> np.ndarray:
    """The inverse of `relayout`: (rows, row_words) uint32 -> the GGUF bytes (rows, row_bytes)."""
    q = gpu_quant(qtype)
    words = np.ascontiguousarray(words, dtype="<u4")
    rows = words.shape[0]
    laid = words.view(np.uint8).reshape(rows, -1, q.block_words * 4)
    out = np.empty((rows, laid.shape[1], q.file_block_bytes), dtype=np.uint8)
    at = 0
    for first, end, widen in q.segments:
        width = 4 if widen else end - first
        part = laid[..., at:at + width]
        if widen:
            part = np.ascontiguousarray(part).view("<f4").astype("<f2").view(np.uint8)
        out[..., first:end] = part
        at += width
    return out.reshape(rows, -1)


def row_words(n_cols: int, qtype) -> int:
    """u32 words of one re-laid row of `n_cols` elements."""
    q = gpu_quant(qtype)
    if n_cols % q.block_elems:
        raise UnsupportedError(f"{q.qtype.name} row of {n_cols} elements, expected a multiple of "
                               f"the GPU block of {q.block_elems}")
    return n_cols // q.block_elems * q.block_words
