"""The GPU dequantization driver: row ranges across row chunks, and the >128 MiB Gemma 3 embedding."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from airframe.gguf_file import GGUFFile, dequantize_rows
from airframe.gpu.dequant import _grid, dequantize, upload
from airframe.gpu.device import get_context
from airframe.models import resolve_model
from airframe.quant_verify import random_bytes


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_K, T.F16], ids=lambda t: t.name)
def test_row_ranges_and_small_windows_match_numpy(qtype):
    cols = 256 if qtype == T.Q4_K else 96
    raw = random_bytes(qtype, 40, cols, np.random.default_rng(7))
    want = dequantize_rows(raw, qtype)
    assert same_bits(dequantize(upload(raw, qtype)), want)
    # chunks of a few rows (a binding limit of 3 rows and a bit): ranges start inside chunks and cross them
    row_bytes = upload(raw[:1], qtype).row_words * 4
    tensor = upload(raw, qtype, max_binding=3 * row_bytes + 64)
    assert len(tensor.chunks) > 5
    for first, count in [(0, 40), (3, 17), (39, 1), (5, 0)]:
        got = dequantize(tensor, first, count)
        assert same_bits(got, want[first:first + count])


def test_rows_outside_the_tensor_are_refused():
    tensor = upload(np.zeros((2, 34), dtype=np.uint8), T.Q8_0)
    with pytest.raises(ValueError, match="rows 1..3 of a tensor with 2 rows"):
        dequantize(tensor, 1, 2)


def test_grid_stays_within_the_dispatch_limit():
    assert _grid(64 * 10, 65535) == (10, 1)
    x, y = _grid(64 * 70000 + 1, 65535)
    assert x == 65535 and x * y * 64 >= 64 * 70000 + 1


def test_gemma3_embedding_larger_than_one_binding():
    gguf = GGUFFile(resolve_model("gemma3-270m"))
    info = gguf.tensor("token_embd.weight")
    raw = gguf.raw(info.name)
    tensor = upload(raw, info.qtype)
    assert tensor.rows * tensor.row_words * 4 > get_context().max_binding  # the case this is for
    assert len(tensor.chunks) > 1
    last = tensor.rows - 100
    got = dequantize(tensor, last, 100)
    assert same_bits(got, dequantize_rows(raw[last:], info.qtype))
