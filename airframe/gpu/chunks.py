"""Splitting a tensor's rows into pieces that fit a binding (or a buffer).

WebGPU binds at most `max-storage-buffer-binding-size` bytes of a storage buffer at once (128 MiB
on lavapipe) and only at offsets that are multiples of `min-storage-buffer-offset-alignment`.
`row_chunks` cuts a row range into windows that respect both: each window starts at an aligned
byte offset at or before its first row, and `skip` says how far into the window that row starts.
With alignment 1 the same cut splits a tensor larger than one buffer into several buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedError


@dataclass(frozen=True)
class RowChunk:
    first_row: int
    n_rows: int
    offset: int  # byte offset of the window, a multiple of the alignment
    size: int  # bytes in the window: skip + n_rows * row_bytes
    skip: int  # bytes from `offset` to the start of `first_row`


def row_chunks(first_row: int, n_rows: int, row_bytes: int, max_bytes: int, alignment: int = 1) -> list[RowChunk]:
    """Windows covering rows [first_row, first_row + n_rows), each at most `max_bytes` long."""
    if first_row < 0 or n_rows < 0 or row_bytes <= 0 or alignment <= 0:
        raise ValueError(f"row_chunks({first_row}, {n_rows}, {row_bytes}, alignment={alignment}): "
                         f"expected rows >= 0, row_bytes > 0 and alignment > 0")
    chunks = []
    row = first_row
    end = first_row + n_rows
    while row < end:
        start = row * row_bytes
        skip = start % alignment
        fit = (max_bytes - skip) // row_bytes
        if fit < 1:
            raise UnsupportedError(f"one row of {row_bytes:,} bytes (starting {skip} bytes past an aligned "
                                   f"offset) does not fit a binding of {max_bytes:,} bytes")
        take = min(fit, end - row)
        chunks.append(RowChunk(row, take, start - skip, skip + take * row_bytes, skip))
        row += take
    return chunks
