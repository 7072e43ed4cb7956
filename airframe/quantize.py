"""Numpy quantizers: float32 rows -> the bytes a GGUF file stores for them.

F32, F16, BF16 and the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) use the `gguf`
package's own encoders. Q4_K, Q5_K and Q6_K have no encoder there, so they are ours: vectorised
over all blocks at once, each sub-block's scale (and min) taken from its range, no search for
optimal rounding and no importance matrix. The bit layouts are those that `gguf.quants`
dequantizes, which is the oracle the tests use.

The K-quant encoders round every scale *up* (the float16 super-block scales too), so no value is
ever clipped: each value is off by at most half of its sub-block's step.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import QK_K, GGMLQuantizationType
from gguf import quants as gguf_quants

from .errors import ParameterError
from .quants import qtype_named, quant

Q = GGMLQuantizationType
_CHUNK_VALUES = 1 << 22  # values per thread task: numpy releases the GIL, tasks amortise the calls


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, cols) float32 -> (rows, row_bytes) uint8, the GGUF encoding of each row."""
    qtype = qtype_named(qtype)
    if values.ndim != 2:
        raise ParameterError(f"quantize takes a 2-D (rows, cols) array, got shape {values.shape}")
    block = quant(qtype).block
    if values.shape[1] % block:
        raise ParameterError(f"row length {values.shape[1]} is not a multiple of the {qtype.name} "
                             f"block of {block} values")
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not np.isfinite(values).all():
        bad = np.argwhere(~np.isfinite(values))[0]
        raise ParameterError(f"value {values[tuple(bad)]} at {tuple(bad.tolist())}: expected finite values")
    out = np.empty((values.shape[0], quant(qtype).row_bytes(values.shape[1])), dtype=np.uint8)
    if values.size == 0:
        return out
    rows_per_chunk = max(1, _CHUNK_VALUES // max(1, values.shape[1]))
    starts = range(0, values.shape[0], rows_per_chunk)
    if len(starts) <= 1:
        out[:] = _quantize_rows(values, qtype)
        return out

    def work(start: int) -> None:
        stop = start + rows_per_chunk
        out[start:stop] = _quantize_rows(values[start:stop], qtype)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(work, starts))
    return out


def _quantize_rows(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    n_rows = rows.shape[0]
    if qtype == Q.F32:
        return rows.view(np.uint8)
    if qtype == Q.F16:
        return rows.astype(np.float16).view(np.uint8)
    if quant(qtype).kind == "k":
        blocks = rows.reshape(-1, QK_K)
        return _K_ENCODERS[qtype](blocks).reshape(n_rows, -1)
    return gguf_quants.quantize(rows, qtype).reshape(n_rows, -1)


# ---- K-quants ------------------------------------------------------------------------------
def _f16_scale(top: np.ndarray, levels: int) -> np.ndarray:
    """(n,) largest sub-block scale -> (n,) float16-exact super-block scale d with
    d * levels >= top, so that no sub-block scale code needs more than `levels`."""
    d = (top / levels).astype(np.float16)
    short = d.astype(np.float32) * levels < top
    d = np.where(short, np.nextafter(d, np.float16(np.inf)), d)
    return d.astype(np.float32)


def _codes(ratio: np.ndarray, top: int) -> np.ndarray:
    """ceil of a non-negative ratio, as 0..top."""
    return np.clip(np.ceil(ratio), 0, top).astype(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0).astype(np.float32)


def _scale_min_search(sub: np.ndarray, levels: int):
    """Asymmetric sub-block quantization shared by Q4_K and Q5_K.

    sub: (n, 8, 32). Returns d, dmin (n,) float32 (already float16-exact), sc, mn (n, 8) 6-bit
    codes, and q (n, 8, 32) codes in 0..levels, with value ~= d*sc*q - dmin*mn.
    """
    low = np.minimum(sub.min(axis=-1), 0)  # the stored min is an offset subtracted, never added
    high = sub.max(axis=-1)
    dmin = _f16_scale((-low).max(axis=-1), 63)
    mn = _codes(_safe_div(-low, dmin[:, None]), 63)
    offset = dmin[:, None] * mn  # (n, 8), >= -low
    scale = (high + offset) / levels
    d = _f16_scale(scale.max(axis=-1), 63)
    sc = _codes(_safe_div(scale, d[:, None]), 63)
    step = d[:, None] * sc
    q = np.rint(_safe_div(sub + offset[..., None], step[..., None]))
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> (n, 12) bytes, the layout `Q4_K.get_scale_min` unpacks:
    bytes 0-3: sc[0:4] with bits 4-5 of sc[4:8] in bits 6-7; bytes 4-7: the same for the mins;
    bytes 8-11: low nibble of sc[4:8] | low nibble of mn[4:8] << 4."""
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_mn, hi_mn = mn[:, :4], mn[:, 4:]
    first = lo_sc | ((hi_sc >> 4) << 6)
    second = lo_mn | ((hi_mn >> 4) << 6)
    third = (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=-1).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 8, 32) codes -> (n, 128) bytes of their low nibbles: byte 32c + i holds element i of
    sub-block 2c (low nibble) and of sub-block 2c + 1 (high nibble)."""
    low = q[:, 0::2, :] & 0x0F
    high = q[:, 1::2, :] & 0x0F
    return (low | (high << 4)).reshape(q.shape[0], 128)


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K blocks from their parts: d, dmin (n,); sc, mn (n, 8) in 0..63; q (n, 8, 32) in 0..15.
    (n, 144) bytes: d f16, dmin f16, 12 scale bytes, 128 nibble bytes; value = d*sc*q - dmin*mn."""
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, mn), _pack_nibbles(q)], axis=-1)


def pack_q5_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q5_K blocks from their parts, as Q4_K with q in 0..31. (n, 176) bytes: d, dmin, 12 scale
    bytes, 32 high-bit bytes (bit j of byte i: fifth bit of element i of sub-block j), 128 nibbles."""
    bits = ((q >> 4) & 1).astype(np.uint8)  # (n, 8, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(bits << shifts, axis=1).astype(np.uint8)  # (n, 32)
    return np.concatenate(
        [_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, mn), qh, _pack_nibbles(q)], axis=-1)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks from their parts: d (n,); sc (n, 16) int8; q (n, 16, 16) in -32..31;
    value = d*sc*q. (n, 210) bytes: 128 low-nibble bytes, 64 high-bit bytes, 16 scales, d f16.

    Element e = 128h + 32g + i (h: half, g: group 0..3) stores q + 32 with its low nibble in byte
    64h + 32(g % 2) + i (high nibble when g >= 2) and its top two bits in byte 128 + 32h + i,
    bits 2g..2g+1.
    """
    n = q.shape[0]
    codes = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # (half, group, i)
    low = codes & 0x0F
    ql = low[:, :, 0:2, :] | (low[:, :, 2:4, :] << 4)  # (n, 2, 2, 32)
    high = codes >> 4
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce(high << shifts, axis=2).astype(np.uint8)  # (n, 2, 32)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16_bytes(d)], axis=-1)


def encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """(n, 256) float32 -> (n, 144) Q4_K bytes."""
    return pack_q4_k(*_scale_min_search(blocks.reshape(-1, 8, 32), 15))


def encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    """(n, 256) float32 -> (n, 176) Q5_K bytes."""
    return pack_q5_k(*_scale_min_search(blocks.reshape(-1, 8, 32), 31))


def encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """(n, 256) float32 -> (n, 210) Q6_K bytes: symmetric codes, one scale per 16 values."""
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31  # (n, 16)
    d = _f16_scale(scale.max(axis=-1), 127)
    sc = _codes(_safe_div(scale, d[:, None]), 127)
    step = d[:, None] * sc
    q = np.clip(np.rint(_safe_div(sub, step[..., None])), -32, 31).astype(np.int8)
    return pack_q6_k(d, sc, q)


_K_ENCODERS = {Q.Q4_K: encode_q4_k, Q.Q5_K: encode_q5_k, Q.Q6_K: encode_q6_k}
