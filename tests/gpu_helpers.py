"""What the shader tests share: a tolerance scaled to the output, and random quantized weights."""

import numpy as np

from airframe.gguf_file import dequantize_rows
from airframe.gpu.pack import relayout
from airframe.quantize import quantize


def close(got, want, rtol):
    """got within rtol times the largest |want| (at least 1) of want, everywhere."""
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(1.0, float(np.abs(want).max())))


def quantized(rng, rows, cols, qtype):
    """(words, float32 weights the GPU must reproduce) of a random matrix."""
    raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return relayout(raw, qtype), dequantize_rows(raw, qtype)
