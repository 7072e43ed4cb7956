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

import math
import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from .errors import GGUFError, UnsupportedError, excerpt

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_STRING = 1 << 26  # 64 MiB: far above any real token or chat template
MAX_KEY = 65535  # the GGUF spec's limit on a key's length
MAX_NAME = 63  # llama.cpp's limit on a tensor name (GGML_MAX_NAME, its NUL excluded)
MAX_ELEMENTS = 1 << 40
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dimension count, one dimension, type, offset
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
    """A bounds-checked little-endian reader over the mapped file. It copies what it reads (mmap
    slices are bytes), so no view of the map outlives a parse and the map can always be closed."""

    def __init__(self, buf, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    @property
    def left(self) -> int:
        return self.size - self.pos

    def fail(self, what: str, found: Any, expected: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}: read {excerpt(found)} at byte {self.pos}, expected {expected}")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left:
            raise self.fail(what, f"{n} bytes", f"at most {self.left} bytes left in the file")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw

    def scalar(self, fmt: str, what: str):
        width = struct.calcsize(fmt)
        if width > self.left:
            raise self.fail(what, f"{width} bytes", f"at most {self.left} bytes left in the file")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += width
        return value

    def string(self, what: str, most: int = MAX_STRING) -> str:
        n = self.scalar("<Q", what + " length")
        if n > most:
            raise self.fail(what + " length", n, f"at most {most}")
        return _decode(self.take(n, what))

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row, walked in one tight loop and decoded in one go (Gemma 3 has
        262,144 tokens)."""
        buf, pos, size, raw = self.buf, self.pos, self.size, []
        unpack, append = struct.Struct("<Q").unpack_from, raw.append
        i = 0
        try:
            for i in range(count):
                n = unpack(buf, pos)[0]
                end = pos + 8 + n
                if n > MAX_STRING or end > size:
                    self.pos = pos
                    raise self.fail(f"{what} item {i} length", n, f"at most {min(MAX_STRING, size - pos - 8)}")
                append(buf[pos + 8:end])
                pos = end
        except struct.error:
            self.pos = pos
            raise self.fail(f"{what} item {i} length", "8 bytes", f"at most {size - pos} bytes left in the file") from None
        self.pos = pos
        try:
            out = b"\0".join(raw).decode("utf-8").split("\0")
            if len(out) == count:
                return out
        except UnicodeDecodeError:
            pass
        return [_decode(r) for r in raw]  # some string holds a NUL or invalid UTF-8

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("<I", what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            self.pos -= 4
            raise self.fail(what, raw, "a GGUF value type 0..12") from None

    def value(self, vtype: GGUFValueType, what: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        item_type = self.value_type(what + " item type")
        if item_type == GGUFValueType.ARRAY:
            raise self.fail(what + " item type", "ARRAY", "arrays of scalars or strings")
        count = self.scalar("<Q", what + " count")
        if item_type in _NUMPY_SCALARS:
            width = np.dtype(_NUMPY_SCALARS[item_type]).itemsize
            if count * width > self.left:
                raise self.fail(what + " count", count, f"at most {self.left // width} items in the bytes left")
            array = np.frombuffer(self.take(count * width, what), dtype=_NUMPY_SCALARS[item_type]).copy()
            return array.astype(bool) if item_type == GGUFValueType.BOOL else array
        if count * 8 > self.left:  # every string takes at least its 8-byte length
            raise self.fail(what + " count", count, f"at most {self.left // 8} items in the bytes left")
        return self.strings(count, what)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace")


# What a metadata value must be where it is read: GGUFFile.value(key, kind).
VALUE_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "string": (lambda v: isinstance(v, str), "a string"),
    "integer": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
               "a finite number"),
    "boolean": (lambda v: isinstance(v, bool), "a boolean"),
    "strings": (lambda v: isinstance(v, list), "an array of strings"),  # string arrays parse as lists
    "numbers": (lambda v: isinstance(v, np.ndarray) and v.dtype.kind in "iuf", "an array of numbers"),
}


class GGUFFile:
    """A validated GGUF file: metadata as Python values, tensors as memory-mapped bytes.

    Every tensor's type, shape and byte range is checked against the others and the file size
    before the constructor returns; on any error the map is closed before the GGUFError leaves.
    Also a context manager: `with GGUFFile(path) as gf: ...` closes it.
    """

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
        try:
            cursor = _Cursor(self._map, self.path)
            self.version, n_tensors, n_kv = self._read_preamble(cursor)
            self.metadata: dict[str, Any] = self._read_metadata(cursor, n_kv)
            self.alignment = self._alignment()
            declared = self._read_tensor_infos(cursor, n_tensors)
            self.data_offset = -(-cursor.pos // self.alignment) * self.alignment
            self.tensors: dict[str, TensorInfo] = self._place_tensors(declared)
        except BaseException:
            self._map.close()
            raise

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- header ---------------------------------------------------------------------------
    def _read_preamble(self, c: _Cursor) -> tuple[int, int, int]:
        magic = c.take(4, "magic")
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
        if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > c.left:
            raise c.fail("metadata and tensor counts", f"{n_kv} and {n_tensors}",
                         f"counts whose entries fit in the {c.left} bytes left")
        return version, n_tensors, n_kv

    def _read_metadata(self, c: _Cursor, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}", MAX_KEY)
            shown = excerpt(key)
            vtype = c.value_type(f"type of {shown}")
            value = c.value(vtype, f"value of {shown}")
            if key in metadata:
                raise GGUFError(f"{self.path}: metadata key {shown} appears twice, expected unique keys")
            metadata[key] = value
        return metadata

    def _alignment(self) -> int:
        value = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 \
                or value & (value - 1) or value > MAX_ALIGNMENT:
            raise GGUFError(f"{self.path}: general.alignment = {excerpt(value)}, "
                            f"expected a power of two up to {MAX_ALIGNMENT}")
        return value

    def _read_tensor_infos(self, c: _Cursor, n_tensors: int) -> list[tuple]:
        declared = []
        seen = set()
        for i in range(n_tensors):
            name = c.string(f"tensor #{i} name", MAX_NAME)
            if name in seen:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice, expected unique names")
            seen.add(name)
            n_dims = c.scalar("<I", f"tensor {name!r} dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                c.pos -= 4
                raise c.fail(f"tensor {name!r} dimension count", n_dims, f"1..{MAX_DIMS}")
            shape = tuple(c.scalar("<Q", f"tensor {name!r} dimension") for _ in range(n_dims))
            raw_type = c.scalar("<I", f"tensor {name!r} type")
            offset = c.scalar("<Q", f"tensor {name!r} offset")
            declared.append((name, shape, raw_type, offset))
        return declared

    def _place_tensors(self, declared: list[tuple]) -> dict[str, TensorInfo]:
        """Tensors in the order declared, each where the one before ends (padded to the
        alignment, as llama.cpp requires), the last one ending the file: no byte of the data
        section belongs to two tensors or to none, so a miscounted or retyped tensor is caught."""
        tensors = {}
        expected, previous = 0, None
        for name, shape, raw_type, offset in declared:
            where = f"{self.path}: tensor {name!r}"
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"{where}: type id {raw_type}, expected a ggml type") from None
            if qtype not in GGML_QUANT_SIZES:
                raise UnsupportedError(f"{where}: type {qtype.name} has no known block size")
            if any(d == 0 for d in shape) or math.prod(shape) > MAX_ELEMENTS:
                raise GGUFError(f"{where}: shape {list(shape)}, expected positive dimensions under 2^40 elements")
            block, type_size = GGML_QUANT_SIZES[qtype]
            if shape[0] % block:
                raise GGUFError(f"{where}: row length {shape[0]} is not a multiple of the "
                                f"{qtype.name} block of {block}")
            if offset % self.alignment:
                raise GGUFError(f"{where}: offset {offset} is not aligned to {self.alignment}")
            n_bytes = math.prod(shape) // block * type_size
            start = self.data_offset + offset
            if start + n_bytes > self.file_size:
                raise GGUFError(f"{where}: bytes {start}..{start + n_bytes} lie beyond the end of the "
                                f"file ({self.file_size} bytes): truncated?")
            if offset != expected:
                after = (f"right after {previous.name!r} ({previous.qtype.name} {list(previous.shape)}) "
                         f"padded to {self.alignment}" if previous else "the start of the data section")
                raise GGUFError(f"{where}: data offset {offset}, expected {expected}, {after}: "
                                f"tensors must follow each other in the order declared")
            previous = tensors[name] = TensorInfo(name, qtype, tuple(shape), start, n_bytes)
            expected = -(-(offset + n_bytes) // self.alignment) * self.alignment
        if declared:
            end = previous.offset + previous.n_bytes
            if self.file_size - end >= self.alignment:
                raise GGUFError(f"{self.path}: {self.file_size - end} bytes follow the last tensor "
                                f"{previous.name!r} (it ends at byte {end}), expected at most "
                                f"{self.alignment - 1} bytes of padding: more tensors than the "
                                f"{len(declared)} declared?")
        return tensors

    # ---- access ---------------------------------------------------------------------------
    @cached_property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: general.architecture = {arch!r}, expected a string")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """The value as stored, of whatever type the file gave it; `value` checks the type."""
        return self.metadata.get(key, default)

    def value(self, key: str, kind: str, default: Any = None) -> Any:
        """The value of `key` if it is of `kind` (VALUE_KINDS: "string", "integer", "number",
        "boolean", "strings", "numbers"), `default` when the key is absent, else a GGUFError."""
        if key not in self.metadata:
            return default
        value = self.metadata[key]
        accepts, expected = VALUE_KINDS[kind]
        if not accepts(value):
            raise GGUFError(f"{self.path}: {key} = {excerpt(value)} ({_type_name(value)}), expected {expected}")
        return value

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
        """Unmap the file. While arrays returned by `raw` are alive the map cannot close; it is
        then unmapped when the last of them goes."""
        try:
            self._map.close()
        except BufferError:
            pass


def _type_name(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array of {value.dtype.name}"
    return "array of strings" if isinstance(value, list) else type(value).__name__


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
