"""Reading GGUF files safely.

The header is walked by a bounded parser of our own: every count, length and offset is checked
against the bytes that are really there before it is used, so a truncated or hostile file gives a
GGUFError that names the file, the key or tensor, the value read and what was expected. Tensor
data stays in the file, memory-mapped (numpy memmap), and is dequantized with the `gguf` package's
own numpy code. Constants (value types, quant types, block sizes) come from the `gguf` package.

Why not `gguf.GGUFReader` itself: it needs ~10 s to index Gemma 3's 262,144-entry vocabulary and
raises assorted exceptions (IndexError, ValueError, MemoryError...) on hostile input.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from .errors import GGUFError, UnsupportedError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_STRING = 1 << 26  # 64 MiB: far above any real key, token or chat template
MAX_DIMS = 4
MAX_ALIGNMENT = 1 << 16
DEFAULT_ALIGNMENT = 32

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_SCALARS = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file declares it. `shape` is in GGUF order: shape[0] is the row length."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.shape[0]

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[0] // block * size


class _Cursor:
    """A bounds-checked little-endian reader over the mapped file."""

    def __init__(self, buf, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, what: str, found: Any, expected: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}: read {found!r} at byte {self.pos}, expected {expected}")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(what, f"{n} bytes", f"at most {len(self.buf) - self.pos} bytes left in the file")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what + " length")
        if n > MAX_STRING:
            raise self.fail(what + " length", n, f"at most {MAX_STRING}")
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return bytes(raw).decode("utf-8", errors="replace")

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("<I", what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(what, raw, "a GGUF value type 0..12") from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if depth > 0:
            raise self.fail(what, "nested array", "arrays of scalars or strings")
        item_type = self.value_type(what + " item type")
        count = self.scalar("<Q", what + " count")
        left = len(self.buf) - self.pos
        if item_type in _NUMPY_SCALARS:
            width = np.dtype(_NUMPY_SCALARS[item_type]).itemsize
            if count * width > left:
                raise self.fail(what + " count", count, f"at most {left // width} items in the bytes left")
            raw = self.take(count * width, what)
            array = np.frombuffer(raw, dtype=_NUMPY_SCALARS[item_type]).copy()
            return array.astype(bool) if item_type == GGUFValueType.BOOL else array
        if count * 8 > left:  # every item takes at least its 8-byte length or type
            raise self.fail(what + " count", count, f"at most {left // 8} items in the bytes left")
        return [self.value(item_type, what, depth + 1) for _ in range(count)]


class GGUFFile:
    """A validated GGUF file: metadata as Python values, tensors as memory-mapped bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size == 0:
                    raise GGUFError(f"{self.path}: empty file, expected a GGUF header")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot read: {e.strerror or e}") from None
        self.file_size = size
        cursor = _Cursor(self._map, self.path)
        self.version, n_tensors, n_kv = self._read_preamble(cursor)
        self.metadata: dict[str, Any] = self._read_metadata(cursor, n_kv)
        self.alignment = self._alignment()
        declared = self._read_tensor_infos(cursor, n_tensors)
        self.data_offset = -(-cursor.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = self._place_tensors(declared)

    # ---- header ---------------------------------------------------------------------------
    def _read_preamble(self, c: _Cursor) -> tuple[int, int, int]:
        magic = bytes(c.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
        version = c.scalar("<I", "version")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version}, expected one of {SUPPORTED_VERSIONS}")
        n_tensors = c.scalar("<Q", "tensor count")
        if n_tensors > MAX_TENSORS:
            raise c.fail("tensor count", n_tensors, f"at most {MAX_TENSORS}")
        n_kv = c.scalar("<Q", "metadata count")
        if n_kv > MAX_KV:
            raise c.fail("metadata count", n_kv, f"at most {MAX_KV}")
        return version, n_tensors, n_kv

    def _read_metadata(self, c: _Cursor, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.value_type(f"type of {key!r}")
            value = c.value(vtype, f"value of {key!r}")
            if key in metadata:
                raise GGUFError(f"{self.path}: metadata key {key!r} appears twice, expected unique keys")
            metadata[key] = value
        return metadata

    def _alignment(self) -> int:
        value = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 \
                or value & (value - 1) or value > MAX_ALIGNMENT:
            raise GGUFError(f"{self.path}: general.alignment = {value!r}, "
                            f"expected a power of two up to {MAX_ALIGNMENT}")
        return value

    def _read_tensor_infos(self, c: _Cursor, n_tensors: int) -> list[tuple]:
        declared = []
        seen = set()
        for i in range(n_tensors):
            name = c.string(f"tensor #{i} name")
            if name in seen:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice, expected unique names")
            seen.add(name)
            n_dims = c.scalar("<I", f"tensor {name!r} dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.fail(f"tensor {name!r} dimension count", n_dims, f"1..{MAX_DIMS}")
            shape = tuple(c.scalar("<Q", f"tensor {name!r} dimension") for _ in range(n_dims))
            raw_type = c.scalar("<I", f"tensor {name!r} type")
            offset = c.scalar("<Q", f"tensor {name!r} offset")
            declared.append((name, shape, raw_type, offset))
        return declared

    def _place_tensors(self, declared: list[tuple]) -> dict[str, TensorInfo]:
        tensors = {}
        for name, shape, raw_type, offset in declared:
            where = f"{self.path}: tensor {name!r}"
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"{where}: type id {raw_type}, expected a ggml type") from None
            if qtype not in GGML_QUANT_SIZES:
                raise UnsupportedError(f"{where}: type {qtype.name} has no known block size")
            if any(d == 0 for d in shape) or np.prod(shape, dtype=object) > (1 << 40):
                raise GGUFError(f"{where}: shape {list(shape)}, expected positive dimensions under 2^40 elements")
            block, type_size = GGML_QUANT_SIZES[qtype]
            if shape[0] % block:
                raise GGUFError(f"{where}: row length {shape[0]} is not a multiple of the "
                                f"{qtype.name} block of {block}")
            if offset % self.alignment:
                raise GGUFError(f"{where}: offset {offset} is not aligned to {self.alignment}")
            n_bytes = int(np.prod(shape, dtype=object)) // block * type_size
            start = self.data_offset + offset
            if start + n_bytes > self.file_size:
                raise GGUFError(f"{where}: bytes {start}..{start + n_bytes} lie beyond the end of the "
                                f"file ({self.file_size} bytes): truncated?")
            tensors[name] = TensorInfo(name, qtype, tuple(int(d) for d in shape), start, n_bytes)
        self._check_overlaps(tensors)
        return tensors

    def _check_overlaps(self, tensors: dict[str, TensorInfo]) -> None:
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset + a.n_bytes > b.offset:
                raise GGUFError(f"{self.path}: tensors {a.name!r} (bytes {a.offset}..{a.offset + a.n_bytes}) "
                                f"and {b.name!r} (from byte {b.offset}) overlap")

    # ---- access ---------------------------------------------------------------------------
    @cached_property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: general.architecture = {arch!r}, expected a string")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of shape (rows, row_bytes)."""
        t = self.tensor(name)
        flat = np.frombuffer(self._map, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        return flat.reshape(t.n_rows, t.row_bytes)

    def raw_rows(self, name: str, first: int, count: int) -> np.ndarray:
        return self.raw(name)[first:first + count]

    def dequantize(self, name: str) -> np.ndarray:
        """float32 array in numpy order: shape reversed from GGUF, last axis = row length."""
        t = self.tensor(name)
        values = dequantize_rows(self.raw(name), t.qtype)
        return values.reshape(tuple(reversed(t.shape)))

    def close(self) -> None:
        self._map.close()


def dequantize_rows(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, row_bytes) uint8 -> (rows, row_length) float32 through the gguf package's numpy code."""
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).copy()
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # damaged scales decode to inf/NaN, as stored
            return np.asarray(gguf_quants.dequantize(np.ascontiguousarray(raw), qtype), dtype=np.float32)
    except NotImplementedError:
        raise UnsupportedError(f"quant type {qtype.name} cannot be dequantized") from None
