"""The quant types airframe runs: one table that every module reads.

For each GGML type: its block in the GGUF file (elements and bytes, from the `gguf` package), how
the GPU lays a block out (`gpu_block` elements re-laid into `gpu_words` 32-bit words, as a list of
segments of the file block, see airframe/gpu/pack.py), its decoder `shaders/quant/<shader>.wgsl`
and decode matmul unit `shaders/gemv/<shader>.wgsl`, where its f16 scales sit in a file block
(quant-verify plants values there), and the type llama.cpp's quantizer falls back to when a row
is not a whole number of blocks. airframe/quantize.py holds the numpy encoders and `gguf.quants`
the decoders that serve as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ParameterError, UnsupportedError

T = GGMLQuantizationType

# A segment is (first byte, end byte, widen) of a file block; widen = an f16 that becomes an f32.
Segment = tuple[int, int, bool]


def _copy(first: int, end: int) -> Segment:
    return (first, end, False)


def _widen(first: int) -> Segment:
    return (first, first + 2, True)


@dataclass(frozen=True)
class QuantType:
    qtype: GGMLQuantizationType
    kind: str                       # "float", "legacy" (32-element blocks) or "k" (256-element super-blocks)
    gpu_block: int                  # elements per GPU block (QK in the shaders)
    gpu_words: int                  # u32 words per re-laid block (BLOCK_WORDS in the shaders)
    segments: tuple[Segment, ...]   # the re-laid block, in order, as pieces of the file block
    scales: tuple[int, ...] = ()    # byte offsets of the f16 scales in a file block
    fallback: GGMLQuantizationType | None = None  # llama.cpp's choice when a row is not whole blocks
    # blocks re-laid together: their first words, then the rest of each block (Q6_K's 4, so that a
    # block's quants start 16-byte aligned), a row's last group padded to `group` first words
    group: int = 1

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def shader(self) -> str:
        """The decoder's name: shaders/quant/<shader>.wgsl."""
        return self.qtype.name.lower()

    @property
    def block(self) -> int:
        """Elements per block in the GGUF file."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        """Bytes per block in the GGUF file."""
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def gpu_block_file_bytes(self) -> int:
        """Bytes of `gpu_block` elements in the GGUF file."""
        return self.gpu_block // self.block * self.block_bytes

    def row_bytes(self, n_cols: int) -> int:
        return n_cols // self.block * self.block_bytes

    def gpu_row_words(self, n_cols: int) -> int:
        """u32 words of one re-laid row of `n_cols` elements."""
        if n_cols % self.gpu_block:
            raise UnsupportedError(f"{self.name} row of {n_cols} elements, expected a multiple of "
                                   f"the GPU block of {self.gpu_block}")
        blocks = n_cols // self.gpu_block
        return blocks * self.gpu_words + -blocks % self.group


_TYPES = (
    # float formats: GPU blocks of 4 elements, stored as in the file
    QuantType(T.F32, "float", 4, 4, (_copy(0, 16),)),
    QuantType(T.F16, "float", 4, 2, (_copy(0, 8),)),
    QuantType(T.BF16, "float", 4, 2, (_copy(0, 8),)),
    # d f16 | 16 B nibbles  ->  d f32 | 4 words
    QuantType(T.Q4_0, "legacy", 32, 5, (_widen(0), _copy(2, 18)), (0,), fallback=T.F16),
    # d f16, m f16 | 16 B nibbles: already aligned
    QuantType(T.Q4_1, "legacy", 32, 5, (_copy(0, 20),), (0, 2), fallback=T.F16),
    # d f16 | qh 4 B | 16 B nibbles  ->  d f32 | qh | 4 words
    QuantType(T.Q5_0, "legacy", 32, 6, (_widen(0), _copy(2, 22)), (0,), fallback=T.F16),
    # d f16, m f16 | qh 4 B | 16 B nibbles: already aligned
    QuantType(T.Q5_1, "legacy", 32, 6, (_copy(0, 24),), (0, 2), fallback=T.F16),
    # d f16 | 32 int8  ->  d f32 | 8 words
    QuantType(T.Q8_0, "legacy", 32, 9, (_widen(0), _copy(2, 34)), (0,), fallback=T.F16),
    # d, dmin f16 | 12 B packed 6-bit scales and mins | 128 B nibbles: already aligned
    QuantType(T.Q4_K, "k", 256, 36, (_copy(0, 144),), (0, 2), fallback=T.Q5_0),
    # d, dmin f16 | 12 B scales | qh 32 B | 128 B nibbles: already aligned
    QuantType(T.Q5_K, "k", 256, 44, (_copy(0, 176),), (0, 2), fallback=T.Q5_1),
    # ql 128 B | qh 64 B | 16 int8 scales | d f16  ->  d f32 | ql | qh | scales, in groups of 4 blocks:
    # 4 d, then 4 x (ql | qh | scales)
    QuantType(T.Q6_K, "k", 256, 53, (_widen(208), _copy(0, 208)), (208,), fallback=T.Q8_0, group=4),
)
QUANTS: dict[GGMLQuantizationType, QuantType] = {q.qtype: q for q in _TYPES}
SUPPORTED: tuple[GGMLQuantizationType, ...] = tuple(QUANTS)


def quant(qtype) -> QuantType:
    """The entry of a quant type; UnsupportedError for a type airframe does not run."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedError(f"quant type id {qtype!r} is not a ggml type; expected one of "
                               f"{', '.join(t.name for t in SUPPORTED)}") from None
    if qtype not in QUANTS:
        raise UnsupportedError(f"quant type {qtype.name} has no GPU decoder; expected one of "
                               f"{', '.join(t.name for t in SUPPORTED)}")
    return QUANTS[qtype]


def qtype_named(name: str | GGMLQuantizationType) -> GGMLQuantizationType:
    """A quant type from its GGUF name ("Q4_K", "bf16"), checked against the table."""
    qtype = name if isinstance(name, GGMLQuantizationType) else GGMLQuantizationType.__members__.get(
        str(name).upper())
    if qtype not in QUANTS:
        raise ParameterError(f"quant type {name!r} is not supported; expected one of "
                             f"{', '.join(t.name for t in SUPPORTED)}")
    return qtype


def compatible_type(qtype: GGMLQuantizationType, row_length: int) -> GGMLQuantizationType:
    """`qtype`, or its fallback (repeatedly) when its block does not divide `row_length`."""
    while row_length % QUANTS[qtype].block:
        qtype = QUANTS[qtype].fallback
    return qtype
