"""GGUFFile on a small valid file, on truncated copies and on randomly damaged copies.

The promise under test: any byte string either loads (and then family.load_config and
dequantize also behave) or gives an AirframeError. Damaged copies run in a forked worker
process with a per-case time limit, so a hang or a crash is reported as such instead of
stopping the suite.
"""

from __future__ import annotations

import multiprocessing
import random
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from airframe.errors import AirframeError, GGUFError, UnsupportedError
from airframe.family import load_config
from airframe.gguf_file import GGUFFile

N_EMBD = 256  # one Q4_K block per row
N_VOCAB = 16
CASE_TIMEOUT_S = 10.0
N_RANDOM_MUTANTS = 2000


# ---- a small valid llama-shaped file ---------------------------------------------------------
def _random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, shape: tuple[int, int]):
    """Quantized bytes for `shape` (numpy order: rows, row length) with sane f16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block * size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q8_0:  # first two bytes of each block: f16 scale
        blocks = raw.reshape(-1, size)
        blocks[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:  # d and dmin: two f16 at the start of each block
        blocks = raw.reshape(-1, size)
        blocks[:, :4] = np.frombuffer(np.array([0.01, 0.001], np.float16).tobytes(), np.uint8)
    return raw


def write_small_gguf(path: Path, seed: int = 0) -> Path:
    """A one-layer llama with metadata of every value type and F32/F16/Q8_0/Q4_K tensors."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(32)
    w.add_block_count(1)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_EMBD)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float64("llama.rope.freq_base", 10000.0)
    w.add_uint64("llama.context_length", 128)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(N_VOCAB)])
    w.add_array("tokenizer.ggml.scores", [float(-i) for i in range(N_VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [1] * N_VOCAB)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_int32("test.i32", -7)
    w.add_int64("test.i64", -(1 << 40))
    w.add_bool("test.flag", True)
    w.add_array("test.bools", [True, False, True])
    Q8, Q4K, F16 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.F16
    n_q, n_kv = N_EMBD, N_EMBD // 2
    tensors = {
        "token_embd.weight": (Q8, (N_VOCAB, N_EMBD)),
        "output_norm.weight": (None, (N_EMBD,)),
        "blk.0.attn_norm.weight": (None, (N_EMBD,)),
        "blk.0.attn_q.weight": (Q4K, (n_q, N_EMBD)),
        "blk.0.attn_k.weight": (Q8, (n_kv, N_EMBD)),
        "blk.0.attn_v.weight": (F16, (n_kv, N_EMBD)),
        "blk.0.attn_output.weight": (Q8, (N_EMBD, n_q)),
        "blk.0.ffn_norm.weight": (None, (N_EMBD,)),
        "blk.0.ffn_gate.weight": (Q4K, (N_EMBD, N_EMBD)),
        "blk.0.ffn_up.weight": (Q8, (N_EMBD, N_EMBD)),
        "blk.0.ffn_down.weight": (Q4K, (N_EMBD, N_EMBD)),
    }
    for name, (qtype, shape) in tensors.items():
        if qtype is None:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        elif qtype == F16:
            w.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(np.float16))
        else:
            w.add_tensor(name, _random_blocks(rng, qtype, shape), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- where the header's fields are ---------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    pos: int
    width: int
    role: str  # "length", "count", "vtype", "ndims", "dim", "ttype", "offset", "alignment", "value"
    value: int


def header_slots(path: Path) -> tuple[list[Slot], list[tuple[int, bytes]], int]:
    """Integer fields of the header, the (position, bytes) of every key and tensor name, data start."""
    reader = GGUFReader(path)
    slots, names = [], []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            role = {"GGUF.tensor_count": "count", "GGUF.kv_count": "count"}.get(field.name, "magic")
            if role == "count":
                slots.append(Slot(field.offset, 8, role, int(field.parts[0][0])))
            continue
        parts, pos = field.parts, field.offset
        positions = []
        for part in parts:
            positions.append(pos)
            pos += part.nbytes
        slots.append(Slot(positions[0], 8, "length", int(parts[0][0])))
        names.append((positions[1], bytes(parts[1])))
        slots.append(Slot(positions[2], 4, "vtype", int(parts[2][0])))
        if field.types[0] == GGUFValueType.ARRAY:
            slots.append(Slot(positions[3], 4, "vtype", int(parts[3][0])))
            slots.append(Slot(positions[4], 8, "count", int(parts[4][0])))
            if field.types[-1] == GGUFValueType.STRING:
                slots += [Slot(positions[i], 8, "length", int(parts[i][0])) for i in range(5, len(parts), 2)]
        elif field.types[0] == GGUFValueType.STRING:
            slots.append(Slot(positions[3], 8, "length", int(parts[3][0])))
        elif field.name == "general.alignment":
            slots.append(Slot(positions[3], 4, "alignment", int(parts[3][0])))
        else:  # a scalar: its raw bits
            slots.append(Slot(positions[3], parts[3].nbytes, "value", int.from_bytes(bytes(parts[3]), "little")))
    for tensor in reader.tensors:
        parts, pos = tensor.field.parts, tensor.field.offset
        positions = []
        for part in parts:
            positions.append(pos)
            pos += part.nbytes
        slots.append(Slot(positions[0], 8, "length", int(parts[0][0])))
        names.append((positions[1], bytes(parts[1])))
        slots.append(Slot(positions[2], 4, "ndims", int(parts[2][0])))
        slots += [Slot(positions[3] + 8 * i, 8, "dim", int(d)) for i, d in enumerate(parts[3])]
        slots.append(Slot(positions[4], 4, "ttype", int(parts[4][0])))
        slots.append(Slot(positions[5], 8, "offset", int(parts[5][0])))
    return slots, names, reader.data_offset


# ---- mutations ------------------------------------------------------------------------------
class Mutator:
    """Damages a copy of the valid file in one of several ways, reproducibly from a seed."""

    def __init__(self, base: bytes, slots: list[Slot], names: list[tuple[int, bytes]], data_offset: int):
        self.base, self.slots, self.names, self.data_offset = base, slots, names, data_offset
        self.offsets = [s.value for s in slots if s.role == "offset"]

    def mutant(self, seed: int) -> tuple[bytes, list[str]]:
        rng = random.Random(seed)
        data = bytearray(self.base)
        done = []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            op = rng.choice((self.flip_byte, self.flip_bit, self.huge_value, self.change_type,
                             self.move_offset, self.duplicate_name, self.bad_alignment, self.change_dim,
                             self.odd_value, self.splice, self.truncate))
            done.append(op(rng, data))
        return bytes(data), done

    def put(self, data: bytearray, slot: Slot, value: int) -> str:
        value %= 1 << (8 * slot.width)
        data[slot.pos:slot.pos + slot.width] = value.to_bytes(slot.width, "little")
        return f"{slot.role}@{slot.pos}={value}"

    def pick(self, rng: random.Random, *roles: str) -> Slot:
        return rng.choice([s for s in self.slots if s.role in roles])

    def flip_byte(self, rng, data):
        pos = rng.randrange(min(len(data), self.data_offset + 64))
        data[pos] = rng.randrange(256)
        return f"byte@{pos}={data[pos]}"

    def flip_bit(self, rng, data):
        pos = rng.randrange(min(len(data), self.data_offset + 64))
        data[pos] ^= 1 << rng.randrange(8)
        return f"bit@{pos}"

    def huge_value(self, rng, data):
        slot = self.pick(rng, "length", "count", "dim", "ndims", "value")
        bits = 8 * slot.width
        value = rng.choice((0, 1, slot.value - 1, slot.value + 1, 1 << (bits - 1), (1 << bits) - 1,
                            1 << 31, 1 << 32, len(self.base), rng.getrandbits(bits)))
        return self.put(data, slot, value)

    def change_type(self, rng, data):
        slot = self.pick(rng, "vtype", "ttype")
        return self.put(data, slot, rng.choice((rng.randrange(64), rng.getrandbits(32))))

    def move_offset(self, rng, data):
        slot = self.pick(rng, "offset")
        value = rng.choice((rng.choice(self.offsets), slot.value + 32, slot.value + 1, slot.value - 32,
                            rng.randrange(len(self.base)) // 32 * 32, 1 << 63, (1 << 64) - 32))
        return self.put(data, slot, value)

    def duplicate_name(self, rng, data):
        pos, name = rng.choice(self.names)
        same = [n for p, n in self.names if len(n) == len(name) and p != pos]
        other = rng.choice(same) if same else name[::-1]
        data[pos:pos + len(name)] = other
        return f"name@{pos}={other!r}"

    def bad_alignment(self, rng, data):
        slot = self.pick(rng, "alignment")
        return self.put(data, slot, rng.choice((0, 1, 3, 16, 48, 64, 4096, 1 << 20, 1 << 31, (1 << 32) - 1)))

    def change_dim(self, rng, data):
        slot = self.pick(rng, "dim")
        return self.put(data, slot, rng.choice((slot.value * 2, slot.value // 2, 32, 1, 257, 1 << 20)))

    def odd_value(self, rng, data):
        """A scalar key (hyperparameters among them) gets NaN, infinity, zero, a huge or negative value."""
        slot = self.pick(rng, "value")
        odd = {4: [0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0xFFFFFFFF, 0x4F800000],
               8: [0x7FF8000000000000, 0x7FF0000000000000, 1 << 63, (1 << 64) - 1, 1 << 40]}
        return self.put(data, slot, rng.choice(odd.get(slot.width, [0]) + [0, 1, rng.getrandbits(8 * slot.width)]))

    def splice(self, rng, data):
        """Delete or insert a few bytes inside the header, shifting everything after them."""
        pos = rng.randrange(min(len(data), self.data_offset))
        n = rng.choice((1, 4, 8, rng.randrange(1, 64)))
        if rng.random() < 0.5:
            del data[pos:pos + n]
            return f"delete@{pos}+{n}"
        data[pos:pos] = bytes(rng.randrange(256) for _ in range(n))
        return f"insert@{pos}+{n}"

    def truncate(self, rng, data):
        keep = rng.randrange(len(data))
        del data[keep:]
        return f"truncate@{keep}"


# ---- what must happen for any byte string ---------------------------------------------------
def outcome(path: Path) -> str:
    """'loaded', 'config', 'rejected: ...' or 'BUG: traceback' for one candidate file."""
    try:
        gf = GGUFFile(path)
    except AirframeError as e:
        return f"rejected: {e}"
    try:
        for name in gf.tensors:
            gf.dequantize(name)
        load_config(gf)
        return "config"
    except AirframeError as e:
        return f"loaded, then: {e}"
    finally:
        gf.close()


def _worker(conn, mutator: Mutator, folder: Path) -> None:
    path = folder / f"mutant-{multiprocessing.current_process().pid}.gguf"
    while (job := conn.recv()) is not None:
        kind, arg = job
        data, ops = (mutator.base[:arg], [f"truncate@{arg}"]) if kind == "truncate" else mutator.mutant(arg)
        path.write_bytes(data)
        try:
            conn.send((outcome(path), ops))
        except BaseException:
            conn.send((f"BUG: {traceback.format_exc()}", ops))


class GuardedRunner:
    """Runs jobs in a forked worker; a job that hangs past the limit or kills the worker is a failure."""

    def __init__(self, mutator: Mutator, folder: Path):
        self.mutator, self.folder = mutator, folder
        self.ctx = multiprocessing.get_context("fork")
        self.proc = None

    def _start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.mutator, self.folder), daemon=True)
        self.proc.start()

    def run(self, job) -> tuple[str, list[str]]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(job)
        if not self.conn.poll(CASE_TIMEOUT_S):
            self.proc.kill()
            self.proc.join()
            return f"BUG: no answer within {CASE_TIMEOUT_S} s (hang)", [str(job)]
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join()
            return f"BUG: worker died with exit code {self.proc.exitcode}", [str(job)]

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(5)


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    return write_small_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf")


@pytest.fixture(scope="module")
def runner(small_gguf, tmp_path_factory):
    slots, names, data_offset = header_slots(small_gguf)
    guarded = GuardedRunner(Mutator(small_gguf.read_bytes(), slots, names, data_offset),
                            tmp_path_factory.mktemp("mutants"))
    yield guarded
    guarded.close()


def copy_with(small_gguf: Path, tmp_path: Path, edit) -> Path:
    data = bytearray(small_gguf.read_bytes())
    edit(data)
    out = tmp_path / "edited.gguf"
    out.write_bytes(bytes(data))
    return out


def slot_of(small_gguf: Path, role: str, index: int = 0) -> Slot:
    return [s for s in header_slots(small_gguf)[0] if s.role == role][index]


# ---- the valid file ---------------------------------------------------------------------------
def test_valid_file_matches_gguf_reader(small_gguf):
    gf = GGUFFile(small_gguf)
    reader = GGUFReader(small_gguf)
    assert gf.architecture == "llama"
    assert gf.version == 3
    assert set(gf.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        ours = gf.tensors[t.name]
        assert ours.qtype == t.tensor_type
        assert list(ours.shape) == [int(d) for d in t.shape]
        assert ours.offset == t.data_offset
        assert ours.n_bytes == t.n_bytes
        assert np.array_equal(gf.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    gf.close()


def test_metadata_of_every_value_type(small_gguf):
    gf = GGUFFile(small_gguf)
    assert gf.get("test.u8") == 200 and gf.get("test.i8") == -100
    assert gf.get("test.u16") == 60000 and gf.get("test.i16") == -30000
    assert gf.get("test.i32") == -7 and gf.get("test.i64") == -(1 << 40)
    assert gf.get("test.flag") is True
    assert gf.get("test.bools").tolist() == [True, False, True]
    assert gf.get("llama.rope.freq_base") == 10000.0
    assert gf.get("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert gf.get("tokenizer.ggml.tokens") == [f"t{i}" for i in range(N_VOCAB)]
    assert gf.get("tokenizer.ggml.scores").tolist() == [float(-i) for i in range(N_VOCAB)]
    assert gf.get("general.alignment") == 32
    assert gf.get("no.such.key", "absent") == "absent"
    gf.close()


def test_dequantize_matches_gguf_reader(small_gguf):
    from gguf import quants

    gf = GGUFFile(small_gguf)
    reader = GGUFReader(small_gguf)
    for t in reader.tensors:
        expected = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(gf.tensors[t.name].shape)))
        got = gf.dequantize(t.name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected.astype(np.float32))
    gf.close()


def test_small_file_config(small_gguf):
    config = load_config(GGUFFile(small_gguf))
    assert (config.n_layers, config.n_embd, config.n_head, config.n_head_kv) == (1, N_EMBD, 4, 2)
    assert config.head_dim == N_EMBD // 4
    assert config.vocab_size == N_VOCAB
    assert config.tied_embeddings


# ---- truncations and random damage --------------------------------------------------------
def _check_all(runner, jobs) -> dict[str, int]:
    counts = {"rejected": 0, "loaded": 0, "config": 0}
    bugs = []
    for job in jobs:
        result, ops = runner.run(job)
        if result.startswith("BUG"):
            bugs.append(f"{job} {ops}: {result}")
        else:
            counts[result.split(",")[0].split(":")[0]] += 1
    assert not bugs, f"{len(bugs)} cases escaped AirframeError; first:\n" + "\n".join(bugs[:3])
    print(counts)
    return counts


def test_every_truncation_of_the_header_is_rejected(runner, small_gguf):
    _, _, data_offset = header_slots(small_gguf)
    size = small_gguf.stat().st_size
    cuts = list(range(0, data_offset + 1)) + list(range(data_offset, size, 997)) + [size - 1]
    counts = _check_all(runner, [("truncate", n) for n in cuts])
    assert counts["config"] == 0 and counts["loaded"] == 0, counts


def test_random_mutants_load_or_raise_airframe_errors(runner):
    counts = _check_all(runner, [("mutant", seed) for seed in range(N_RANDOM_MUTANTS)])
    # Both outcomes must really occur, or the mutator is not exercising the parser.
    assert counts["rejected"] > N_RANDOM_MUTANTS // 4, counts
    assert counts["config"] > 10, counts


# ---- targeted damage: the message names the file, the place, the value and the expectation ----
def _error(path: Path, kind=GGUFError) -> str:
    with pytest.raises(kind) as info:
        gf = GGUFFile(path)
        load_config(gf)
    message = str(info.value)
    assert str(path) in message
    return message


def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    assert "magic b'GGML'" in _error(path) and "b'GGUF'" in _error(path)
    path.write_bytes(b"")
    assert "empty file" in _error(path)
    with pytest.raises(GGUFError, match="cannot read"):
        GGUFFile(tmp_path)


def test_huge_tensor_count(small_gguf, tmp_path):
    count = slot_of(small_gguf, "count", 0)
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(count.pos, count.pos + 8),
                                                                      (1 << 62).to_bytes(8, "little")))
    message = _error(path)
    assert "tensor count" in message and str(1 << 62) in message and "at most" in message


def test_huge_string_length_names_the_key(small_gguf, tmp_path):
    reader = GGUFReader(small_gguf)
    field = reader.fields["tokenizer.ggml.model"]
    value_len_pos = field.offset + 8 + len(field.name) + 4
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(value_len_pos, value_len_pos + 8),
                                                                      (1 << 40).to_bytes(8, "little")))
    message = _error(path)
    assert "'tokenizer.ggml.model'" in message and str(1 << 40) in message and "at most" in message


def test_huge_array_count_names_the_key(small_gguf, tmp_path):
    reader = GGUFReader(small_gguf)
    field = reader.fields["tokenizer.ggml.scores"]
    count_pos = field.offset + 8 + len(field.name) + 4 + 4
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(count_pos, count_pos + 8),
                                                                     (1 << 50).to_bytes(8, "little")))
    message = _error(path)
    assert "'tokenizer.ggml.scores' count" in message and str(1 << 50) in message and "items" in message


def test_bad_value_type_names_the_key(small_gguf, tmp_path):
    reader = GGUFReader(small_gguf)
    field = reader.fields["test.u16"]
    type_pos = field.offset + 8 + len(field.name)
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(type_pos, type_pos + 4),
                                                                     (99).to_bytes(4, "little")))
    message = _error(path)
    assert "'test.u16'" in message and "99" in message and "value type" in message


def test_bad_tensor_type_names_the_tensor(small_gguf, tmp_path):
    slot = slot_of(small_gguf, "ttype", 3)  # blk.0.attn_q.weight
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(slot.pos, slot.pos + 4),
                                                                     (77).to_bytes(4, "little")))
    message = _error(path)
    assert "'blk.0.attn_q.weight'" in message and "77" in message and "ggml type" in message


def test_tensor_past_the_end_names_the_tensor(small_gguf, tmp_path):
    slot = slot_of(small_gguf, "offset", 10)  # the last tensor
    size = small_gguf.stat().st_size
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(slot.pos, slot.pos + 8),
                                                                     (slot.value + 4096).to_bytes(8, "little")))
    message = _error(path)
    assert "'blk.0.ffn_down.weight'" in message and f"({size} bytes)" in message and "beyond the end" in message


def test_overlapping_tensors_are_refused(small_gguf, tmp_path):
    first, second = slot_of(small_gguf, "offset", 1), slot_of(small_gguf, "offset", 2)
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(second.pos, second.pos + 8),
                                                                     first.value.to_bytes(8, "little")))
    message = _error(path)
    assert "'blk.0.attn_norm.weight': data offset" in message and "right after 'output_norm.weight'" in message
    assert "in the order declared" in message


def test_misaligned_offset_names_the_tensor(small_gguf, tmp_path):
    slot = slot_of(small_gguf, "offset", 4)
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(slot.pos, slot.pos + 8),
                                                                     (slot.value + 4).to_bytes(8, "little")))
    message = _error(path)
    assert "'blk.0.attn_k.weight'" in message and str(slot.value + 4) in message and "aligned to 32" in message


def test_duplicate_tensor_name(small_gguf, tmp_path):
    _, names, _ = header_slots(small_gguf)
    (k_pos, _), = [(p, n) for p, n in names if n == b"blk.0.attn_k.weight"]
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(k_pos, k_pos + 19), b"blk.0.attn_q.weight"))
    message = _error(path)
    assert "'blk.0.attn_q.weight' appears twice" in message


def test_bad_alignment_value(small_gguf, tmp_path):
    slot = slot_of(small_gguf, "alignment")
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(slot.pos, slot.pos + 4),
                                                                     (48).to_bytes(4, "little")))
    message = _error(path)
    assert "general.alignment = 48" in message and "power of two" in message


def test_row_not_a_multiple_of_the_block(small_gguf, tmp_path):
    slot = slot_of(small_gguf, "dim", 0)  # token_embd.weight (Q8_0), row length 256
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(slot.pos, slot.pos + 8),
                                                                     (250).to_bytes(8, "little")))
    message = _error(path)
    assert "'token_embd.weight'" in message and "250" in message and "Q8_0 block of 32" in message


def test_unsupported_architecture(tmp_path):
    w = GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("x", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = _error(tmp_path / "m.gguf", UnsupportedError)
    assert "'mamba'" in message and "llama" in message


def test_gap_between_tensors_is_refused(small_gguf, tmp_path):
    slot = slot_of(small_gguf, "offset", 10)  # the last tensor moves on by one alignment unit
    path = copy_with(small_gguf, tmp_path, lambda d: (d.__setitem__(slice(slot.pos, slot.pos + 8),
                                                                      (slot.value + 32).to_bytes(8, "little")),
                                                       d.extend(bytes(32))))
    message = _error(path)
    assert f"'blk.0.ffn_down.weight': data offset {slot.value + 32}, expected {slot.value}" in message


def test_bytes_after_the_last_tensor_are_refused(small_gguf, tmp_path):
    """A tensor count one short leaves the last tensor's bytes unread (and its info read as data)."""
    count = slot_of(small_gguf, "count", 0)
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(count.pos, count.pos + 8),
                                                                      (10).to_bytes(8, "little")))
    message = _error(path)
    assert "bytes follow the last tensor 'blk.0.ffn_up.weight'" in message and "more tensors than the 10 declared" in message


def test_long_tensor_name_is_refused_with_a_short_message(small_gguf, tmp_path):
    _, names, _ = header_slots(small_gguf)
    (pos, name), = [(p, n) for p, n in names if n == b"blk.0.attn_k.weight"]
    length_pos = pos - 8
    path = copy_with(small_gguf, tmp_path, lambda d: d.__setitem__(slice(length_pos, length_pos + 8),
                                                                      (1 << 20).to_bytes(8, "little")))
    message = _error(path)
    assert "tensor #4 name length" in message and str(1 << 20) in message and "at most 63" in message
    assert len(message) < 300


def test_values_are_type_checked_where_read(small_gguf):
    with GGUFFile(small_gguf) as gf:
        assert gf.value("tokenizer.ggml.model", "string") == "llama"
        assert gf.value("llama.context_length", "integer") == 128
        assert gf.value("llama.rope.freq_base", "number") == 10000.0
        assert gf.value("test.flag", "boolean") is True
        assert gf.value("tokenizer.ggml.tokens", "strings")[:2] == ["t0", "t1"]
        assert gf.value("tokenizer.ggml.scores", "numbers").shape == (N_VOCAB,)
        assert gf.value("no.such.key", "string", "fallback") == "fallback"
        with pytest.raises(GGUFError, match=r"tokenizer.ggml.tokens = \['t0', 't1', 't2', 't3', ...\] "
                                            r"\(16 items\) \(array of strings\), expected a string"):
            gf.value("tokenizer.ggml.tokens", "string")
        with pytest.raises(GGUFError, match=r"tokenizer.ggml.scores = .* \(array of float32\), expected an integer"):
            gf.value("tokenizer.ggml.scores", "integer")
        with pytest.raises(GGUFError, match="test.flag = True .*expected an integer"):
            gf.value("test.flag", "integer")


def test_the_map_is_closed_on_every_error(small_gguf, tmp_path, monkeypatch):
    import mmap as mmap_module

    maps = []

    class Recorded(mmap_module.mmap):
        def __new__(cls, *args, **kwargs):
            m = super().__new__(cls, *args, **kwargs)
            maps.append(m)
            return m

    monkeypatch.setattr("airframe.gguf_file.mmap.mmap", Recorded)
    for cut in (30, 200, small_gguf.stat().st_size - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(small_gguf.read_bytes()[:cut])
        with pytest.raises(GGUFError):
            GGUFFile(path)
    assert len(maps) == 3 and all(m.closed for m in maps)
    with GGUFFile(small_gguf) as gf:
        view = gf.raw("output_norm.weight")
    assert view.sum() >= 0  # a view outliving close() keeps the bytes readable
