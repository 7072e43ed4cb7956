"""Mutation fuzzing of the GGUF loading path, for tests/test_gguf_fuzz.py.

A base model (a valid GGUF) is walked once (`layout`); each mutation class is a generator that
damages it in one way, reproducibly from (class, base, case index). A mutant is a new header plus
byte patches of the tensor data plus an optional cut, so a case of a 250 MB model costs a few
writes to one working copy instead of a copy of the file. Every case runs in a forked worker
under an address-space limit with a time limit: the loading path must end in the project's own
error (AirframeError) or load; any other exception, a hang, a crash or a memory blow-up is a bug.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import resource
import shutil
import struct
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked

V = GGUFValueType
SCALAR_FORMATS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
                  V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
CASE_SECONDS = 10.0  # a case past this is a hang
MEMORY_HEADROOM = 3 << 30  # address space a case may add to its worker's before it is a blow-up
GGML_TYPES = [int(t) for t in GGML_QUANT_SIZES]


# ---- the layout of a valid file --------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One metadata entry: its bytes are base[start:end]; the value's bytes start at value_pos."""

    key: str
    start: int
    type_pos: int
    value_pos: int
    end: int
    vtype: int
    item_type: int | None  # arrays only
    count: int | None
    lengths: tuple[int, ...]  # positions of the 8-byte string lengths inside the value (first few)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    start: int  # its name length
    ndims_pos: int
    dims_pos: int
    n_dims: int
    type_pos: int
    offset_pos: int
    end: int


@dataclass
class Layout:
    size: int
    alignment: int
    entries: list[Entry]
    tensors: list[TensorEntry]
    kv_start: int  # = 24, after magic, version and the two counts
    infos_end: int  # the end of the tensor infos
    data_offset: int  # where tensor data starts
    tensor_ranges: list[tuple[str, int, int]] = field(default_factory=list)  # (name, start, end) in the data


def _u64(buf, pos):
    return struct.unpack_from("<Q", buf, pos)[0], pos + 8


def _string(buf, pos):
    n, pos = _u64(buf, pos)
    return bytes(buf[pos:pos + n]).decode("utf-8", "replace"), pos + n


def layout(buf) -> Layout:
    """Walk a valid GGUF (bytes or mmap): every entry's and tensor info's positions."""
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, entries, alignment = 24, [], 32
    for _ in range(n_kv):
        start = pos
        key, pos = _string(buf, pos)
        type_pos = pos
        vtype = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        value_pos, item_type, count, lengths = pos, None, None, []
        if vtype == V.STRING:
            lengths.append(pos)
            _, pos = _string(buf, pos)
        elif vtype == V.ARRAY:
            item_type, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item_type == V.STRING:
                for i in range(count):
                    if i < 4:
                        lengths.append(pos)
                    n, pos = _u64(buf, pos)
                    pos += n
            else:
                pos += count * struct.calcsize(SCALAR_FORMATS[V(item_type)])
        else:
            if key == "general.alignment":
                alignment = struct.unpack_from(SCALAR_FORMATS[V(vtype)], buf, pos)[0]
            pos += struct.calcsize(SCALAR_FORMATS[V(vtype)])
        entries.append(Entry(key, start, type_pos, value_pos, pos, vtype, item_type, count, tuple(lengths)))
    tensors, raw = [], []
    for _ in range(n_tensors):
        start = pos
        name, pos = _string(buf, pos)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        type_pos = pos + 4 + 8 * n_dims
        ttype, offset = struct.unpack_from("<IQ", buf, type_pos)
        tensors.append(TensorEntry(name, start, pos, pos + 4, n_dims, type_pos, type_pos + 4, type_pos + 12))
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        raw.append((name, offset, offset + math.prod(dims) // block * size))
        pos = type_pos + 12
    data_offset = -(-pos // alignment) * alignment
    return Layout(len(buf), alignment, entries, tensors, 24, pos, data_offset, raw)


# ---- mutants ---------------------------------------------------------------------------------
@dataclass
class Mutant:
    """The file `head + base[data_offset:]`, with `patches` (offset in the data section, bytes)
    written over its data, cut to `cut` bytes when set."""

    head: bytes
    patches: list[tuple[int, bytes]]
    cut: int | None
    what: str


def encode_string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def encode_value(vtype: int, value) -> bytes:
    """The bytes of a value (after its type id) of GGUF type `vtype`; arrays are (item_type, items)."""
    if vtype == V.STRING:
        return encode_string(value)
    if vtype == V.ARRAY:
        item_type, items = value
        body = b"".join(encode_value(item_type, v) for v in items)
        return struct.pack("<IQ", item_type, len(items)) + body
    return struct.pack(SCALAR_FORMATS[V(vtype)], value)


def encode_entry(key: str, vtype: int, value) -> bytes:
    return encode_string(key) + struct.pack("<I", vtype) + encode_value(vtype, value)


class Base:
    """A valid model file and what the mutation classes need to know of it."""

    def __init__(self, name: str, path: Path, deep: bool):
        self.name, self.path, self.deep = name, Path(path), deep
        with open(self.path, "rb") as f:
            self.head = f.read(16 << 20)  # every header here is smaller
        self.layout = layout(self.head)
        self.layout.size = self.path.stat().st_size  # layout() saw only the header's bytes
        self.head = self.head[:self.layout.data_offset]
        self.data_size = self.layout.size - self.layout.data_offset

    def scalar_entries(self) -> list[Entry]:
        return [e for e in self.layout.entries if e.vtype in SCALAR_FORMATS]

    def value_of(self, e: Entry):
        """The Python value of an entry (arrays: (item_type, first items))."""
        if e.vtype in SCALAR_FORMATS:
            return struct.unpack_from(SCALAR_FORMATS[V(e.vtype)], self.head, e.value_pos)[0]
        if e.vtype == V.STRING:
            return _string(self.head, e.value_pos)[0]
        return e.item_type, None

    def rebuilt(self, entries: list[bytes], n_kv: int | None = None, infos: bytes | None = None,
                n_tensors: int | None = None) -> bytes:
        """A header of these entry bytes and tensor infos, padded to the alignment with zeros."""
        lay = self.layout
        infos = self.head[lay.entries[-1].end if lay.entries else 24:lay.infos_end] if infos is None else infos
        counts = struct.pack("<QQ", len(lay.tensors) if n_tensors is None else n_tensors,
                             len(entries) if n_kv is None else n_kv)
        head = self.head[:8] + counts + b"".join(entries) + infos
        return head + bytes(-len(head) % lay.alignment)

    def entry_bytes(self) -> list[bytes]:
        return [self.head[e.start:e.end] for e in self.layout.entries]

    def put(self, pos: int, fmt: str, value, what: str) -> Mutant:
        head = bytearray(self.head)
        width = struct.calcsize(fmt)
        if fmt in ("<f", "<d"):
            head[pos:pos + width] = struct.pack(fmt, value)
        else:
            head[pos:pos + width] = (int(value) % (1 << (8 * width))).to_bytes(width, "little")
        return Mutant(bytes(head), [], None, what)


def _odd_integer(rng: random.Random, old: int, bits: int) -> int:
    return rng.choice((0, 1, old - 1, old + 1, old * 2, old // 2, (1 << bits) - 1, 1 << (bits - 1),
                       1 << 31, 1 << 32, rng.getrandbits(bits)))


def swap_value_type(rng: random.Random, b: Base) -> Mutant:
    """A value's type id changed, its bytes left as they are: the rest of the header misparses."""
    e = rng.choice(b.layout.entries)
    new = rng.choice([t for t in range(13) if t != e.vtype] + [13, 255, rng.getrandbits(32)])
    return b.put(e.type_pos, "<I", new, f"type of {e.key} {e.vtype} -> {new}")


def retype_value(rng: random.Random, b: Base) -> Mutant:
    """A value well-formed but of another type than the reader expects (a count as a string, a
    float as a u64, a string as a bool...)."""
    entries = b.entry_bytes()
    i = rng.randrange(len(entries))
    e = b.layout.entries[i]
    value = b.value_of(e)
    if e.vtype == V.ARRAY:
        choices = [(V.STRING, "array"), (V.UINT32, 7), (V.FLOAT32, 1.5)]
    elif e.vtype == V.STRING:
        choices = [(V.UINT32, len(value)), (V.BOOL, True), (V.FLOAT32, 2.5), (V.INT64, -1)]
    else:
        number = float(value) if e.vtype in (V.FLOAT32, V.FLOAT64) else int(value)
        choices = [(V.STRING, str(value)), (V.BOOL, bool(value)), (V.FLOAT32, float(number) + 0.5),
                   (V.FLOAT64, float(number)), (V.INT8, -1), (V.UINT64, int(abs(number)) if math.isfinite(number) else 0),
                   (V.INT32, -int(min(abs(number), 1 << 30)) if math.isfinite(number) else -1)]
    vtype, new = rng.choice(choices)
    entries[i] = encode_entry(e.key, vtype, new)
    return Mutant(b.rebuilt(entries), [], None, f"{e.key} retyped to {V(vtype).name} {new!r:.40}")


def array_for_string(rng: random.Random, b: Base) -> Mutant:
    """A string value (the architecture, the tokenizer model, the chat template...) or a scalar
    stored as an array: of strings, of numbers, or empty."""
    entries = b.entry_bytes()
    candidates = [i for i, e in enumerate(b.layout.entries) if e.vtype != V.ARRAY]
    i = rng.choice(candidates)
    e = b.layout.entries[i]
    value = b.value_of(e)
    text = value if isinstance(value, str) else str(value)
    new = rng.choice([(V.STRING, [text[:200], text[:200]]), (V.STRING, []), (V.STRING, [text[:200]]),
                      (V.FLOAT32, [1.0, 2.0]), (V.UINT32, []), (V.UINT8, list(text[:64].encode())),
                      (V.BOOL, [True]), (V.INT64, [1 << 40] * 3)])
    entries[i] = encode_entry(e.key, V.ARRAY, new)
    return Mutant(b.rebuilt(entries), [], None, f"{e.key} as an array of {V(new[0]).name} ({len(new[1])} items)")


def tensor_info_field(rng: random.Random, b: Base) -> Mutant:
    """One field of a tensor's info: its dimension count, a dimension, its type or its offset."""
    t = rng.choice(b.layout.tensors)
    kind = rng.choice(("n_dims", "dim", "type", "offset"))
    if kind == "n_dims":
        return b.put(t.ndims_pos, "<I", rng.choice((0, 1, 2, 3, 4, 5, t.n_dims - 1, t.n_dims + 1, 1 << 31)),
                     f"{t.name} n_dims")
    if kind == "dim":
        at = t.dims_pos + 8 * rng.randrange(t.n_dims)
        old = struct.unpack_from("<Q", b.head, at)[0]
        return b.put(at, "<Q", _odd_integer(rng, old, 64), f"{t.name} dim")
    if kind == "type":
        return b.put(t.type_pos, "<I", rng.choice(GGML_TYPES + [rng.randrange(64), rng.getrandbits(32)]),
                     f"{t.name} type")
    old = struct.unpack_from("<Q", b.head, t.offset_pos)[0]
    other = struct.unpack_from("<Q", b.head, rng.choice(b.layout.tensors).offset_pos)[0]
    a = b.layout.alignment
    return b.put(t.offset_pos, "<Q", rng.choice((other, old + a, old - a, old + 1, 0, b.data_size, 1 << 63,
                                                 (1 << 64) - a, rng.randrange(b.data_size) // a * a)),
                 f"{t.name} offset")


def change_counts(rng: random.Random, b: Base) -> Mutant:
    """The header's tensor count or metadata count off by a little or a lot."""
    pos, old, what = rng.choice(((8, len(b.layout.tensors), "n_tensors"), (16, len(b.layout.entries), "n_kv")))
    new = rng.choice((old - 1, old + 1, old - rng.randint(2, 5), old + rng.randint(2, 5), 0, 1 << 20,
                      (1 << 20) + 1, 1 << 63, (1 << 64) - 1))
    return b.put(pos, "<Q", max(new, 0), f"{what} {old} -> {new}")


def truncate(rng: random.Random, b: Base) -> Mutant:
    """The file cut short: in the header, in the tensor data, or by its last few bytes."""
    where = rng.random()
    if where < 0.5:
        cut = rng.randrange(b.layout.data_offset)
    elif where < 0.9:
        cut = b.layout.data_offset + rng.randrange(b.data_size)
    else:
        cut = b.layout.size - rng.randint(1, 64)
    return Mutant(b.head, [], cut, f"cut at {cut} of {b.layout.size}")


def data_noise(rng: random.Random, b: Base) -> Mutant:
    """Random bytes, NaN or infinity patterns or zeros written over the tensor data."""
    n = rng.choice((1, 2, 4, 16, 256, 1024, rng.randint(1, 1024)))
    where = rng.random()
    if where < 0.5:  # at the start of a tensor, where a block's scale is
        _, start, _ = rng.choice(b.layout.tensor_ranges)
        pos = start + rng.choice((0, 0, 2, rng.randrange(64)))
    else:
        pos = rng.randrange(max(1, b.data_size - n))
    kind = rng.choice(("random", "random", "nan16", "inf32", "zeros"))
    if kind == "random":
        patch = bytes(rng.getrandbits(8) for _ in range(n))
    elif kind == "nan16":
        patch = (np.float16(np.nan).tobytes() * n)[:n]
    elif kind == "inf32":
        patch = (np.float32(np.inf).tobytes() * n)[:n]
    else:
        patch = bytes(n)
    return Mutant(b.head, [(pos, patch[:max(0, b.data_size - pos)])], None, f"{n} {kind} bytes at data {pos}")


def string_length(rng: random.Random, b: Base) -> Mutant:
    """A string's 8-byte length (a key, a value, an array item, a tensor name) made huge, zero or off by one."""
    slots = [(e.start, f"key {e.key}") for e in b.layout.entries]
    slots += [(p, f"value of {e.key}") for e in b.layout.entries for p in e.lengths]
    slots += [(t.start, f"name of {t.name}") for t in b.layout.tensors]
    pos, what = rng.choice(slots)
    old = struct.unpack_from("<Q", b.head, pos)[0]
    new = rng.choice((old + 1, old - 1, 0, 1 << 20, 1 << 26, (1 << 26) + 1, 1 << 40, (1 << 64) - 1,
                      b.layout.size, rng.getrandbits(32)))
    return b.put(pos, "<Q", new, f"length of {what} {old} -> {new}")


def odd_number(rng: random.Random, b: Base) -> Mutant:
    """A scalar value (hyperparameters, token ids, flags) set to 0, -1, NaN, infinity or a huge value."""
    e = rng.choice(b.scalar_entries())
    fmt = SCALAR_FORMATS[V(e.vtype)]
    if fmt in ("<f", "<d"):
        return b.put(e.value_pos, fmt, rng.choice((0.0, -1.0, math.nan, math.inf, -math.inf, 1e30, 1e-30)),
                     f"{e.key} odd float")
    width = struct.calcsize(fmt)
    old = int.from_bytes(b.head[e.value_pos:e.value_pos + width], "little")
    return b.put(e.value_pos, fmt.upper() if fmt != "<?" else "<B", _odd_integer(rng, old, 8 * width),
                 f"{e.key} odd integer")


def drop_or_repeat(rng: random.Random, b: Base) -> Mutant:
    """An entry or a tensor info left out or written twice, the counts following (or not)."""
    entries = b.entry_bytes()
    lay = b.layout
    infos = [b.head[t.start:t.end] for t in lay.tensors]
    kind = rng.choice(("drop entry", "repeat entry", "drop tensor", "repeat tensor", "swap tensors"))
    i = rng.randrange(len(entries) if "entry" in kind else len(infos))
    honest = rng.random() < 0.7  # the count follows the change
    if kind == "drop entry":
        what = lay.entries[i].key
        del entries[i]
        head = b.rebuilt(entries, n_kv=None if honest else len(lay.entries))
    elif kind == "repeat entry":
        what = lay.entries[i].key
        entries.insert(i, entries[i])
        head = b.rebuilt(entries, n_kv=None if honest else len(lay.entries))
    else:
        what = lay.tensors[i].name
        if kind == "drop tensor":
            del infos[i]
        elif kind == "repeat tensor":
            infos.insert(i, infos[i])
        else:
            j = rng.randrange(len(infos))
            infos[i], infos[j] = infos[j], infos[i]
        head = b.rebuilt(entries, infos=b"".join(infos), n_tensors=len(infos) if honest else None)
    return Mutant(head, [], None, f"{kind} {what}" + ("" if honest else ", count unchanged"))


MUTATIONS: dict[str, Callable[[random.Random, Base], Mutant]] = {
    "value type id swapped": swap_value_type,
    "value of another type": retype_value,
    "array where a scalar or string belongs": array_for_string,
    "tensor info field changed": tensor_info_field,
    "tensor or metadata count changed": change_counts,
    "truncated": truncate,
    "noise in tensor data": data_noise,
    "string length changed": string_length,
    "odd number": odd_number,
    "entry or tensor dropped, repeated or swapped": drop_or_repeat,
}


def mutant(base: Base, mutation: str, index: int) -> Mutant:
    """Case `index` of a mutation class on a base: the same bytes on every run."""
    return MUTATIONS[mutation](random.Random(f"{mutation}/{base.name}/{index}"), base)


# ---- the working copy ------------------------------------------------------------------------
class WorkFile:
    """One worker's copy of a base file, edited into each mutant and back."""

    def __init__(self, base: Base, path: Path):
        self.base, self.path = base, path
        shutil.copyfile(base.path, path)
        self.undo: list[tuple[int, int]] = []  # (position, length) to copy back from the base
        self.whole = False  # the file must be copied back entirely

    def _copy_back(self, src, dst, start: int, length: int, to: int | None = None) -> None:
        """base[start:start + length] written at `to` (default: the same place), in the kernel."""
        dst.seek(start if to is None else to)
        dst.flush()
        while length > 0:
            done = os.sendfile(dst.fileno(), src.fileno(), start, length)
            if done <= 0:
                raise OSError(f"sendfile copied nothing from byte {start} of {self.base.path}")
            start, length = start + done, length - done

    def write(self, m: Mutant) -> None:
        b = self.base
        with open(b.path, "rb") as src, open(self.path, "r+b") as dst:
            if len(m.head) != len(b.head):  # the data moves: the file is rewritten
                dst.truncate(0)
                dst.write(m.head)
                self._copy_back(src, dst, b.layout.data_offset, b.data_size, len(m.head))
                self.whole = True
            else:
                if self.whole:  # the last mutant moved the data: back to the base first
                    dst.truncate(0)
                    self._copy_back(src, dst, 0, b.layout.size)
                    self.whole = False
                dst.seek(0)
                dst.write(m.head)
                self.undo.append((0, len(b.head)))
            for pos, patch in m.patches:
                dst.seek(len(m.head) + pos)
                dst.write(patch)
                self.undo.append((b.layout.data_offset + pos, len(patch)))
            if m.cut is not None:
                dst.truncate(m.cut)
                self.undo.append((m.cut, b.layout.size - m.cut))

    def restore(self) -> None:
        """Undo the in-place edits; a moved file is left for the next `write` to replace."""
        if not self.whole:
            with open(self.base.path, "rb") as src, open(self.path, "r+b") as dst:
                for pos, length in self.undo:
                    self._copy_back(src, dst, pos, length)
        self.undo = []


# ---- the loading path ------------------------------------------------------------------------
def load(path: Path, base: Base, patches: list[tuple[int, bytes]]) -> str:
    """What a user's load does with the file; raises what the project raises.

    Deep (tiny models): the engine loads it on the reference backend with --check-tensors and
    runs a chat prompt. Shallow (the real models, where a full load takes seconds): the model,
    config, tokenizer metadata and chat template are read and rendered, every tensor whose info
    differs from the base file's is dequantized, and of the others the rows whose bytes differ
    (the rest are the base's own bytes; a whole 150K-token embedding takes seconds).
    """
    from airframe.chat_template import ChatTemplate
    from airframe.engine import Engine
    from airframe.gguf_file import dequantize_rows
    from airframe.model import open_model
    from airframe.options import RunOptions
    from airframe.tokenizer import read_vocab

    messages = [{"role": "user", "content": "Hi"}]
    if base.deep:
        engine = Engine.load(path, backend="reference", options=RunOptions(n_ctx=64, check_tensors=True))
        try:
            ids = engine.tokenize_prompt(messages)[:16]
            logits = engine.backend.forward(ids)
            return "loaded" if np.isfinite(logits).all() else "loaded (non-finite logits)"
        finally:
            engine.backend.model.gf.close()
    model = open_model(path)
    gf = model.gguf
    try:
        vocab = read_vocab(gf)
        bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else ""
        ChatTemplate.for_model(gf.value("tokenizer.chat_template", "string"), model.config.family, bos, "",
                               str(path)).render(messages)
        known = {(t.name, s, e) for t, (_, s, e) in zip(base.layout.tensors, base.layout.tensor_ranges)}
        for t in gf.tensors.values():
            start, end = t.offset - gf.data_offset, t.offset - gf.data_offset + t.n_bytes
            hit = [(p, p + len(q)) for p, q in patches if p < end and start < p + len(q)]
            if (t.name, start, end) not in known:
                gf.dequantize(t.name)
            elif hit:
                first = max(0, min(p for p, _ in hit) - start) // t.row_bytes
                last = min(t.n_rows, (max(q for _, q in hit) - start - 1) // t.row_bytes + 1)
                dequantize_rows(gf.raw(t.name)[first:last], t.qtype)
        return "loaded"
    finally:
        gf.close()


def outcome(path: Path, base: Base, patches: list[tuple[int, bytes]]) -> str:
    """'loaded', 'error: <class>' for the project's own errors, 'BUG: <traceback>' for any other."""
    from airframe.errors import AirframeError

    try:
        return load(path, base, patches)
    except AirframeError as e:
        return f"error: {type(e).__name__}"
    except BaseException:
        return "BUG: " + traceback.format_exc(limit=6)


# ---- workers ---------------------------------------------------------------------------------
def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _worker(conn, bases: dict[str, Base], folder: Path) -> None:
    warnings.simplefilter("ignore")  # a damaged model's overflows in numpy are expected, not news
    limit = _address_space() + MEMORY_HEADROOM + sum(b.layout.size for b in bases.values())
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    work = {name: WorkFile(b, folder / f"{os.getpid()}-{name}.gguf") for name, b in bases.items()}
    while (job := conn.recv()) is not None:
        name, mutation, index = job
        base, wf = bases[name], work[name]
        m = mutant(base, mutation, index)
        wf.write(m)
        start = time.perf_counter()
        result = outcome(wf.path, base, m.patches)
        seconds = time.perf_counter() - start
        wf.restore()
        conn.send((result, m.what, seconds))


@dataclass
class Case:
    base: str
    mutation: str
    index: int
    outcome: str = ""
    what: str = ""
    seconds: float = 0.0


class Fuzzer:
    """Runs cases in `n_workers` forked workers; a worker past CASE_SECONDS is killed (a hang) and
    one that dies (a crash, a kill for memory) is replaced."""

    def __init__(self, bases: list[Base], folder: Path, n_workers: int = 2):
        self.bases = {b.name: b for b in bases}
        self.folder = folder
        self.ctx = multiprocessing.get_context("fork")
        self.n_workers = n_workers

    def _start(self):
        conn, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child, self.bases, self.folder), daemon=True)
        proc.start()
        child.close()
        return proc, conn

    def run(self, cases: list[Case], on_case: Callable[[Case], None] | None = None) -> list[Case]:
        pending = list(reversed(cases))
        workers = [self._start() for _ in range(min(self.n_workers, len(cases)))]
        busy: dict[int, tuple[Case, float]] = {}  # worker index -> (case, started)
        while pending or busy:
            for w, (proc, conn) in enumerate(workers):
                if w not in busy and pending:
                    case = pending.pop()
                    conn.send((case.base, case.mutation, case.index))
                    busy[w] = (case, time.monotonic())
            ready = wait([workers[w][1] for w in busy], timeout=0.5)
            for w in list(busy):
                proc, conn = workers[w]
                case, started = busy[w]
                if conn in ready:
                    try:
                        case.outcome, case.what, case.seconds = conn.recv()
                    except EOFError:
                        proc.join()
                        case.outcome = f"BUG: the worker died (exit code {proc.exitcode})"
                        workers[w] = self._start()
                elif time.monotonic() - started > CASE_SECONDS:
                    proc.kill()
                    proc.join()
                    case.outcome, case.seconds = f"BUG: no answer within {CASE_SECONDS:.0f} s (hang)", CASE_SECONDS
                    workers[w] = self._start()
                else:
                    continue
                del busy[w]
                if on_case:
                    on_case(case)
        for proc, conn in workers:
            conn.send(None)
            proc.join(10)
        return cases


def plan(bases: list[Base], per_base: int, first: int = 0) -> list[Case]:
    """Cases first..per_base - 1 of each base, the mutation classes taking turns (a long run can
    be split between machines by `first`)."""
    names = list(MUTATIONS)
    return [Case(b.name, names[i % len(names)], i // len(names)) for b in bases for i in range(first, per_base)]


def table(cases: list[Case]) -> str:
    """Outcome counts per base, as a Markdown table."""
    bases = list(dict.fromkeys(c.base for c in cases))
    counts = Counter((c.base, _kind(c.outcome)) for c in cases)
    kinds = sorted({k for _, k in counts}, key=lambda k: (k.startswith("BUG"), k != "loaded", k))
    lines = ["| outcome | " + " | ".join(bases) + " |", "|---" * (len(bases) + 1) + "|"]
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(f"{counts[b, k]:,}" for b in bases) + " |")
    slowest = {b: max(c.seconds for c in cases if c.base == b) for b in bases}
    lines.append("| slowest case (s) | " + " | ".join(f"{slowest[b]:.2f}" for b in bases) + " |")
    return "\n".join(lines)


def _kind(outcome: str) -> str:
    return outcome.splitlines()[-1][:120] if outcome.startswith("BUG") else outcome
