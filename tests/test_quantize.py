"""airframe.quantize against the gguf package's numpy dequantizers (the oracle).

Tolerances are per block, relative to the block's own values:
  F16: 2^-11 relative (plus 2^-25 for subnormals); BF16: 2^-8 relative (round to nearest).
  Q8_0: 0.57 * amax/127 (half a step, plus the f16 rounding of d over 127 steps).
  Q4_0 / Q5_0: one step, amax/8 and amax/16 (the code range is -8..7 / -16..15 and the largest
    magnitude maps to -8 / -16, so the opposite extreme can be clipped by a full step).
  Q4_1 / Q5_1: half a step, range/15 and range/31, plus the f16 rounding of the min and step.
  Q4_K / Q5_K: half a step of the super-block; a step is at most (range + amax/63)/levels
    grown by 1/63 for the 6-bit scale rounded up (levels 15 / 31).
  Q6_K: half a step, at most amax/31 * (1 + 1/127).
"""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from airframe.errors import ParameterError
from airframe.quantize import pack_q4_k, pack_q5_k, pack_q6_k, quantize
from airframe.quants import SUPPORTED, compatible_type, quant, qtype_named


def dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    return np.asarray(gguf_quants.dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], -1)


def bound(x: np.ndarray, qtype: Q) -> np.ndarray:
    """The largest error allowed for each value of x (rows, cols), from its block's values."""
    block = GGML_QUANT_SIZES[qtype][0]
    blocks = x.reshape(-1, block).astype(np.float64)
    amax = np.abs(blocks).max(axis=1)
    span = blocks.max(axis=1) - blocks.min(axis=1)
    low = np.minimum(blocks.min(axis=1), 0)
    k_span = blocks.max(axis=1) - low
    if qtype == Q.F16:  # relative to each value, and half the f16 subnormal spacing
        return np.abs(x) * 2.0 ** -11 + 2.0 ** -25
    if qtype == Q.BF16:
        return np.abs(x) * 2.0 ** -8
    per_block = {
        Q.F32: 0 * amax,
        Q.Q8_0: 0.57 * amax / 127,
        Q.Q4_0: 1.01 * amax / 8,
        Q.Q5_0: 1.01 * amax / 16,
        Q.Q4_1: 0.5 * span / 15 + amax * 2.0 ** -9,
        Q.Q5_1: 0.5 * span / 31 + amax * 2.0 ** -9,
        Q.Q4_K: 0.5 * (k_span + amax / 63) / 15 * (1 + 1 / 63) * 1.01,
        Q.Q5_K: 0.5 * (k_span + amax / 63) / 31 * (1 + 1 / 63) * 1.01,
        Q.Q6_K: 0.5 * amax / 31 * (1 + 1 / 127) * 1.01,
    }[qtype]
    return np.repeat(per_block, block).reshape(x.shape) + 1e-12


def check_round_trip(x: np.ndarray, qtype: Q) -> None:
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8
    assert raw.shape == (x.shape[0], quant(qtype).row_bytes(x.shape[1]))
    err = np.abs(dequantize(raw, qtype) - x)
    allowed = bound(x, qtype)
    worst = np.unravel_index(np.argmax(err - allowed), x.shape)
    assert np.all(err <= allowed), f"{qtype.name}: error {err[worst]} > {allowed[worst]} at {worst}"


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_rows_round_trip(qtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 512)).astype(np.float32) * 0.02
    x[1] += 0.05  # all positive
    x[2] -= 0.1  # all negative
    x[3] *= 100  # large values
    x[4] = 0  # zero blocks
    x[5, ::7] = 3.0  # outliers
    x[6] = rng.uniform(-1, 1, 512)
    check_round_trip(x, qtype)


FIXED_BLOCKS = {
    "ramp": np.linspace(-1, 1, 256, dtype=np.float32),
    "constant": np.full(256, 0.5, dtype=np.float32),
    "negative": -np.linspace(0.5, 1.5, 256, dtype=np.float32),
    "spike": np.where(np.arange(256) == 100, 4.0, 0.01).astype(np.float32),
    "zeros": np.zeros(256, dtype=np.float32),
}


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("case", FIXED_BLOCKS)
def test_fixed_blocks_round_trip(qtype, case):
    check_round_trip(FIXED_BLOCKS[case].reshape(1, 256), qtype)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_zeros_encode_to_zero(qtype):
    raw = quantize(np.zeros((2, 256), dtype=np.float32), qtype)
    assert np.all(dequantize(raw, qtype) == 0)


def test_q4_k_pack_is_bit_exact_with_gguf_unpacking():
    rng = np.random.default_rng(3)
    n = 64
    d = rng.uniform(0.5, 2, n).astype(np.float16).astype(np.float32)
    dmin = rng.uniform(0.5, 2, n).astype(np.float16).astype(np.float32)
    sc = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    mn = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    q = rng.integers(0, 16, (n, 8, 32), dtype=np.uint8)
    raw = pack_q4_k(d, dmin, sc, mn, q)
    assert raw.shape == (n, 144)
    got_sc, got_mn = gguf_quants.Q4_K.get_scale_min(raw[:, 4:16])
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_mn, mn)
    want = d[:, None, None] * sc[..., None] * q - dmin[:, None, None] * mn[..., None]
    np.testing.assert_array_equal(dequantize(raw, Q.Q4_K), want.astype(np.float32).reshape(n, 256))


def test_q5_k_pack_is_bit_exact_with_gguf_unpacking():
    rng = np.random.default_rng(4)
    n = 64
    d = rng.uniform(0.5, 2, n).astype(np.float16).astype(np.float32)
    dmin = rng.uniform(0.5, 2, n).astype(np.float16).astype(np.float32)
    sc = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    mn = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    q = rng.integers(0, 32, (n, 8, 32), dtype=np.uint8)
    raw = pack_q5_k(d, dmin, sc, mn, q)
    assert raw.shape == (n, 176)
    want = d[:, None, None] * sc[..., None] * q - dmin[:, None, None] * mn[..., None]
    np.testing.assert_array_equal(dequantize(raw, Q.Q5_K), want.astype(np.float32).reshape(n, 256))


def test_q6_k_pack_is_bit_exact_with_gguf_unpacking():
    rng = np.random.default_rng(5)
    n = 64
    d = rng.uniform(0.5, 2, n).astype(np.float16).astype(np.float32)
    sc = rng.integers(-128, 128, (n, 16), dtype=np.int8)
    q = rng.integers(-32, 32, (n, 16, 16), dtype=np.int8)
    raw = pack_q6_k(d, sc, q)
    assert raw.shape == (n, 210)
    want = d[:, None, None] * sc[..., None].astype(np.float32) * q
    np.testing.assert_array_equal(dequantize(raw, Q.Q6_K), want.astype(np.float32).reshape(n, 256))


def test_q6_k_constant_block_bytes():
    """All values equal to the block maximum: every code is the top one (31 + 32 = 63), so every
    low-nibble byte and every high-bit byte is 0xFF and every scale is 127."""
    raw = quantize(np.ones((1, 256), dtype=np.float32), Q.Q6_K)[0]
    assert np.all(raw[:128] == 0xFF)
    assert np.all(raw[128:192] == 0xFF)
    assert np.all(raw[192:208] == 127)
    d = raw[208:210].view(np.float16)[0]
    assert abs(float(d) * 127 * 31 - 1) < 2e-3


def test_q4_k_constant_block_bytes():
    """Positive constant block: min offset 0 (dmin 0, mins 0), every scale 63 (so bytes 0-3 are
    0b11_111111 with sc[4:8]'s top bits, bytes 8-11 hold sc[4:8]'s low nibble 0xF), codes 15."""
    raw = quantize(np.ones((1, 256), dtype=np.float32), Q.Q4_K)[0]
    assert raw[2:4].view(np.float16)[0] == 0
    assert np.all(raw[4:8] == 0xFF)
    assert np.all(raw[8:12] == 0)
    assert np.all(raw[12:16] == 0x0F)
    assert np.all(raw[16:] == 0xFF)


def test_quantize_checks_its_input():
    with pytest.raises(ParameterError, match="multiple of the Q4_K block of 256"):
        quantize(np.zeros((2, 64), dtype=np.float32), Q.Q4_K)
    with pytest.raises(ParameterError, match="2-D"):
        quantize(np.zeros(256, dtype=np.float32), Q.Q8_0)
    with pytest.raises(ParameterError, match=r"value nan at \(1, 5\): expected finite"):
        x = np.zeros((2, 256), dtype=np.float32)
        x[1, 5] = np.nan
        quantize(x, Q.Q4_K)
    with pytest.raises(ParameterError, match="Q3_K"):
        qtype_named("Q3_K")
    assert quantize(np.zeros((0, 256), dtype=np.float32), Q.Q6_K).shape == (0, 210)
    assert qtype_named("bf16") == Q.BF16


def test_compatible_type_follows_llama_cpp_fallbacks():
    assert compatible_type(Q.Q4_K, 640) == Q.Q5_0
    assert compatible_type(Q.Q5_K, 640) == Q.Q5_1
    assert compatible_type(Q.Q6_K, 640) == Q.Q8_0
    assert compatible_type(Q.Q6_K, 48) == Q.F16
    assert compatible_type(Q.Q4_K, 2048) == Q.Q4_K
    assert compatible_type(Q.BF16, 7) == Q.BF16


def test_large_inputs_are_split_across_threads_without_changing_bytes():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4200, 1024)).astype(np.float32)  # > one 4M-value chunk
    whole = quantize(x, Q.Q4_K)
    parts = np.concatenate([quantize(x[:2000], Q.Q4_K), quantize(x[2000:], Q.Q4_K)])
    np.testing.assert_array_equal(whole, parts)
