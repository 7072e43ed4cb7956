"""`--check-tensors`: scan a model's weights for NaN and infinity before they are loaded.

Float tensors (F32, F16, BF16, F64) are checked value by value; quantized ones by their block
scales alone, since a block's values are its scales times small integers and so are finite
exactly when the scales are (SCALE_FIELDS). A type not in that table is dequantized and checked
whole. The scan reads every byte of the file once, in chunks, so its memory stays small.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm import tqdm

from .errors import GGUFError
from .gguf_file import GGUFFile, TensorInfo, dequantize_rows

Q = GGMLQuantizationType
CHUNK_BYTES = 1 << 24

# (float width, bit mask of the exponent) of a float's raw bits: all exponent bits set = inf/NaN
FLOAT_BITS = {Q.F32: ("<u4", 0x7F800000), Q.F16: ("<u2", 0x7C00), Q.BF16: ("<u2", 0x7F80),
              Q.F64: ("<u8", 0x7FF0000000000000)}
F16_BITS = FLOAT_BITS[Q.F16]
# byte offsets of the f16 scales in each block (ggml's block_* structs, as gguf.quants reads them)
SCALE_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}


def check_tensors(gf: GGUFFile, progress: bool = False) -> None:
    """GGUFError naming the first tensor that holds a non-finite value or block scale."""
    tensors = sorted(gf.tensors.values(), key=lambda t: t.offset)
    with tqdm(total=sum(t.n_bytes for t in tensors), desc="checking tensors", unit="B", unit_scale=True,
              disable=not progress, leave=False) as bar:
        for t in tensors:
            raw = gf.raw(t.name)
            rows_per_chunk = max(1, CHUNK_BYTES // t.row_bytes)
            for first in range(0, t.n_rows, rows_per_chunk):
                bad = _bad_rows(raw[first:first + rows_per_chunk], t)
                if bad.size:
                    what = "a value" if t.qtype in FLOAT_BITS else "a block scale"
                    raise GGUFError(f"{gf.path}: tensor {t.name!r} ({t.qtype.name} {list(t.shape)}) has "
                                    f"{what} that is NaN or infinite in row {first + int(bad[0])} of {t.n_rows}; "
                                    f"expected finite weights: the file is damaged")
                bar.update(min(rows_per_chunk, t.n_rows - first) * t.row_bytes)


def _bad_rows(rows: np.ndarray, t: TensorInfo) -> np.ndarray:
    """Indices of the rows of `rows` (uint8, one row of the tensor each) that hold a non-finite value."""
    if t.qtype in FLOAT_BITS:
        dtype, mask = FLOAT_BITS[t.qtype]
        bits = rows.view(dtype)
        return np.flatnonzero(((bits & mask) == mask).any(axis=1))
    if t.qtype in SCALE_FIELDS:
        _, size = GGML_QUANT_SIZES[t.qtype]
        blocks = rows.reshape(rows.shape[0], -1, size)
        dtype, mask = F16_BITS
        bad = np.zeros(rows.shape[0], dtype=bool)
        for at in SCALE_FIELDS[t.qtype]:
            bits = np.ascontiguousarray(blocks[:, :, at:at + 2]).view(dtype)
            bad |= ((bits & mask) == mask).any(axis=(1, 2))
        return np.flatnonzero(bad)
    return np.flatnonzero(~np.isfinite(dequantize_rows(rows, t.qtype)).all(axis=1))
