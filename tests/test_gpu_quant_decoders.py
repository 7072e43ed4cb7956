"""The GPU layout of each quant type (pack.relayout), and its WGSL decoder (shaders/quant/) against the
gguf package's numpy code.

Decoding is integer unpacking plus products that are exact in float32 and at most one rounded
add, so the GPU must give the very same float32 bits as `gguf.quants.dequantize`.
"""

import re

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gguf_quants

from airframe.errors import UnsupportedError
from airframe.gguf_file import dequantize_rows
from airframe.gpu.dequant import dequantize, upload
from airframe.gpu.pack import relayout, restore
from airframe.quants import SUPPORTED, quant
from airframe.resources import shader_path

QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def random_blocks(qtype, rows, cols, seed=0):
    """Random bytes with every f16 scale replaced by a finite one of a realistic size."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in quant(qtype).scales:
        sane = rng.uniform(-2e-2, 2e-2, size=raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = sane.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def quieted(values):
    """float32 values with the quiet bit set on every NaN, as the GPU's f16 conversion does."""
    bits = values.view(np.uint32).copy()
    bits[np.isnan(values)] |= 0x00400000
    return bits.view(np.float32)


def assert_same_bits(got, want):
    assert got.shape == want.shape
    differ = got.view(np.uint32) != want.view(np.uint32)
    where = np.argwhere(differ)[:5]
    assert not differ.any(), f"{differ.sum()} values differ, first at {where.tolist()}: " \
                             f"{got[tuple(where.T)]} vs {want[tuple(where.T)]}"


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_shader_constants_match_the_table(qtype):
    q = quant(qtype)
    text = shader_path(f"quant/{q.shader}.wgsl").read_text()
    assert re.search(rf"const QK: u32 = {q.gpu_block}u;", text)
    assert re.search(rf"const BLOCK_WORDS: u32 = {q.gpu_words}u;", text)
    assert len(re.findall(r"^fn dq4\(blk: u32, i: u32\) -> vec4<f32>", text, re.MULTILINE)) == 1
    assert q.gpu_words * 4 >= q.gpu_block_file_bytes and q.gpu_block % 4 == 0


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_relayout_is_lossless(qtype):
    raw = random_blocks(qtype, 3, 512, seed=1)
    words = relayout(raw, qtype)
    assert words.dtype == np.uint32 and words.shape == (3, quant(qtype).gpu_row_words(512))
    assert np.array_equal(restore(words, qtype), raw)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_gpu_decodes_random_blocks_bit_exactly(qtype):
    raw = random_blocks(qtype, 5, 1280, seed=2)
    got = dequantize(upload(raw, qtype))
    want = dequantize_rows(raw, qtype)
    assert_same_bits(got, quieted(want) if qtype == T.F16 else want)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_gpu_decodes_quantized_values_bit_exactly(qtype):
    values = np.random.default_rng(3).normal(0, 0.05, size=(4, 256)).astype(np.float32)
    raw = np.asarray(gguf_quants.quantize(values, qtype)).view(np.uint8).reshape(4, -1)
    got = dequantize(upload(raw, qtype))
    assert_same_bits(got, dequantize_rows(raw, qtype))
    assert np.abs(got - values).max() < 0.05  # the round trip is a quantization, not garbage


def test_q4_0_small_fixed_block():
    # d = 0.5, byte j = (j, 15 - j): element j = 0.5 * (j - 8), element j + 16 = 0.5 * (7 - j)
    nibbles = np.arange(16, dtype=np.uint8)
    block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), nibbles | ((15 - nibbles) << 4)])
    got = dequantize(upload(block.reshape(1, 18), T.Q4_0))[0]
    want = 0.5 * np.concatenate([nibbles - 8.0, 7.0 - nibbles])
    assert np.array_equal(got, want.astype(np.float32))


def test_f16_every_bit_pattern():
    # All 65,536 halves: exact, except that signaling NaNs come back quiet (quiet bit set, payload kept):
    # the GPU's f16->f32 conversion quiets them while numpy keeps the bits.
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(64, -1)
    got = dequantize(upload(raw, T.F16)).view(np.uint32).ravel()
    want = dequantize_rows(raw, T.F16).view(np.uint32).ravel()
    half = np.arange(1 << 16)
    signaling = ((half & 0x7C00) == 0x7C00) & ((half & 0x3FF) != 0) & ((half & 0x200) == 0)
    assert np.array_equal(got[~signaling], want[~signaling])
    assert np.array_equal(got[signaling], want[signaling] | 0x00400000)


def test_bf16_keeps_every_bit():
    raw = np.random.default_rng(4).integers(0, 256, size=(4, 1024), dtype=np.uint8)
    assert_same_bits(dequantize(upload(raw, T.BF16)), dequantize_rows(raw, T.BF16))


@pytest.mark.parametrize("qtype", [T.Q2_K, T.IQ4_NL, 999], ids=str)
def test_unsupported_type_is_named(qtype):
    with pytest.raises(UnsupportedError, match=str(getattr(qtype, "name", qtype))):
        quant(qtype)


def test_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(UnsupportedError, match="Q8_0 row of 35 bytes"):
        relayout(np.zeros((2, 35), dtype=np.uint8), T.Q8_0)
    with pytest.raises(UnsupportedError, match="expected a 2-D uint8"):
        relayout(np.zeros(34, dtype=np.uint8), T.Q8_0)
    with pytest.raises(UnsupportedError, match="F32 row of 6 elements"):
        quant(T.F32).gpu_row_words(6)
