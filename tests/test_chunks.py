"""Row windows that fit a binding: aligned starts, sizes within the limit, every row exactly once."""

import pytest
from hypothesis import given, settings, strategies as st

from airframe.errors import UnsupportedError
from airframe.gpu.chunks import row_chunks


def test_small_fixed_case():
    # rows of 108 bytes, windows of at most 400 bytes at offsets aligned to 32
    chunks = row_chunks(0, 7, 108, 400, 32)
    assert [(c.first_row, c.n_rows, c.offset, c.skip) for c in chunks] == [
        (0, 3, 0, 0), (3, 3, 320, 4), (6, 1, 640, 8)]
    assert [c.size for c in chunks] == [324, 328, 116]


@settings(max_examples=200, deadline=None)
@given(first=st.integers(0, 5000), n=st.integers(0, 5000), row_bytes=st.integers(1, 3000).map(lambda x: 4 * x),
       rows_per_window=st.integers(1, 50), alignment=st.sampled_from([1, 4, 32, 256]))
def test_windows_cover_the_rows_within_the_limits(first, n, row_bytes, rows_per_window, alignment):
    max_bytes = rows_per_window * row_bytes + alignment
    chunks = row_chunks(first, n, row_bytes, max_bytes, alignment)
    assert sum(c.n_rows for c in chunks) == n
    row = first
    for c in chunks:
        assert c.first_row == row and c.n_rows >= 1
        assert c.offset % alignment == 0 and c.offset + c.skip == c.first_row * row_bytes
        assert 0 <= c.skip < alignment and c.size == c.skip + c.n_rows * row_bytes <= max_bytes
        row += c.n_rows


def test_alignment_one_splits_into_back_to_back_buffers():
    chunks = row_chunks(0, 10, 100, 350)
    assert [(c.offset, c.size, c.skip) for c in chunks] == [(0, 300, 0), (300, 300, 0), (600, 300, 0), (900, 100, 0)]


def test_a_row_larger_than_the_binding_is_refused():
    with pytest.raises(UnsupportedError, match="one row of 4,096 bytes"):
        row_chunks(0, 2, 4096, 4000, 256)


def test_negative_rows_are_a_programming_error():
    with pytest.raises(ValueError):
        row_chunks(-1, 2, 16, 64)
