"""The plan validator: runs before every launch and on every package load.

Each task's reads and writes are derived from its opcode and fields (`task_ranges`) as blocks of
rows in named buffers. The checks:
  - every block lies inside its buffer, and nothing writes the read-only buffers;
  - within a wave no two tasks write the same element, and each (opcode, layer) writes its whole
    output exactly once;
  - every read of the activation arena or of the current position's K/V rows was written by an
    earlier wave of the same token: never by its own wave, never only by a later one;
  - the plan was made for this target and this plan_format.h (the fingerprint).
The K/V caches are two buffers each: the past (positions < p, read-only within a token, bounded by
the chunk envelopes for every p < ctx) and the row at the current position p ("know", "vnow").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import AirframeError
from .opcodes import CONST_NAMES, TASK_DTYPE, Op
from .target import Target, fingerprint

READ_ONLY = ("weights", "kcache", "vcache")


class PlanError(AirframeError):
    """A megakernel plan or package is inconsistent; the message names the task, wave and range."""


@dataclass(frozen=True)
class Block:
    """rows x row_len elements of `buf` starting at `start`, consecutive rows `stride` apart."""

    buf: str
    start: int
    rows: int = 1
    row_len: int = 0
    stride: int = 0

    @property
    def end(self) -> int:  # one past the last element touched
        return self.start + (self.rows - 1) * self.stride + self.row_len if self.rows and self.row_len else self.start

    def __str__(self) -> str:
        if self.rows == 1:
            return f"{self.buf}[{self.start}:{self.start + self.row_len}]"
        return f"{self.buf}[{self.start}:{self.end}] ({self.rows} rows of {self.row_len}, stride {self.stride})"


def _flat(buf: str, start: int, length: int) -> Block:
    return Block(buf, start, 1, length, length)


def buffer_sizes(k: dict) -> dict[str, int]:
    """Elements per buffer (bytes for weights)."""
    kv = k["n_layers"] * k["n_head_kv"]
    return {"weights": k["weights_size"], "act": k["act_size"],
            "kcache": kv * k["ctx"] * k["head_dim"], "vcache": kv * k["ctx"] * k["head_dim_v"],
            "know": kv * k["head_dim"], "vnow": kv * k["head_dim_v"]}


def n_qkv(k: dict) -> int:
    return (k["n_head"] + k["n_head_kv"]) * k["head_dim"] + k["n_head_kv"] * k["head_dim_v"]


def attn_record(k: dict) -> int:
    return k["head_dim_v"] + 2  # m, l, o[head_dim_v]


def act(k: dict, name: str, layer: int = 0) -> int:
    """Arena offset of an activation: "x" (x[layer]), "qkv", "attn", "h", "ffn" (of a layer),
    or "xn", "logits", "cand"."""
    if name == "x":
        return k["act_x"] + layer * k["act_x_stride"]
    if name in ("qkv", "attn", "h", "ffn"):
        return k["act_layer"] + layer * k["act_layer_size"] + k[f"lay_{name}"]
    return k[f"act_{name}"]


def task_ranges(t, k: dict) -> tuple[list[Block], list[Block]]:
    """(reads, writes) of one task, as blocks; weights in bytes, everything else in floats."""
    op, r0, n, layer = int(t["opcode"]), int(t["row_start"]), int(t["row_count"]), int(t["layer"])
    e = k["n_embd"]
    if op == Op.EMBED:
        table = k["vocab"] * e * 2  # the token's row is chosen at run time: the whole table is the envelope
        return [_flat("weights", int(t["weight0"]), table)], [_flat("act", act(k, "x", 0) + r0, n)]
    if op == Op.QKV:
        reads = [_flat("act", act(k, "x", layer), e), _flat("weights", int(t["norm"]), e * 4),
                 _flat("weights", int(t["weight0"]) + r0 * e * 2, n * e * 2)]
        writes = [_flat("act", act(k, "qkv", layer) + r0, n)]
        v_first = (k["n_head"] + k["n_head_kv"]) * k["head_dim"]
        lo, hi = max(r0, v_first), r0 + n
        if hi > lo:  # the task's V rows also go to the V cache at the current position
            base = layer * k["n_head_kv"] * k["head_dim_v"]
            writes.append(_flat("vnow", base + lo - v_first, hi - lo))
        return reads, writes
    if op == Op.ATTN:
        return _attn_ranges(t, k)
    if op == Op.WO:
        n_in = k["n_head"] * k["head_dim_v"]
        reads = [_flat("act", act(k, "attn", layer), k["attn_chunks"] * k["n_head"] * attn_record(k)),
                 _flat("weights", int(t["weight0"]) + r0 * n_in * 2, n * n_in * 2),
                 _flat("act", act(k, "x", layer) + r0, n)]
        return reads, [_flat("act", act(k, "h", layer) + r0, n)]
    if op == Op.FFN:
        reads = [_flat("act", act(k, "h", layer), e), _flat("weights", int(t["norm"]), e * 4)]
        reads += [_flat("weights", int(t[w]) + r0 * e * 2, n * e * 2) for w in ("weight0", "weight1", "weight2")]
        return reads, [_flat("act", act(k, "ffn", layer) + int(t["slot"]) * e, e)]
    if op == Op.FFN_REDUCE:
        parts = Block("act", act(k, "ffn", layer) + r0, k["ffn_parts"], n, e)
        return [parts, _flat("act", act(k, "h", layer) + r0, n)], [_flat("act", act(k, "x", layer + 1) + r0, n)]
    if op == Op.FINAL_NORM:
        reads = [_flat("act", act(k, "x", k["n_layers"]), e), _flat("weights", int(t["norm"]), e * 4)]
        return reads, [_flat("act", act(k, "xn") + r0, n)]
    if op == Op.LM_HEAD:
        reads = [_flat("act", act(k, "xn"), e), _flat("weights", int(t["weight0"]) + r0 * e * 2, n * e * 2)]
        return reads, [_flat("act", act(k, "logits") + r0, n), _flat("act", act(k, "cand") + 2 * int(t["slot"]), 2)]
    raise PlanError(f"opcode {op}, expected one of {', '.join(f'{o.value} {o.name}' for o in Op if o)}")


def _attn_ranges(t, k: dict) -> tuple[list[Block], list[Block]]:
    layer, head, chunk = int(t["layer"]), int(t["head"]), int(t["slot"])
    hd, hdv, g = k["head_dim"], k["head_dim_v"], k["n_head"] // k["n_head_kv"]
    first = int(t["row_start"])
    count = max(0, min(int(t["row_count"]), k["ctx"] - first))
    lh = layer * k["n_head_kv"] + head
    rec = attn_record(k)
    table = k["ctx"] * (k["rope_dim"] // 2) * 4
    qkv = act(k, "qkv", layer)
    reads = [_flat("act", qkv + head * g * hd, g * hd),
             _flat("act", qkv + k["n_head"] * hd + head * hd, hd),
             _flat("weights", k["rope_cos"], table), _flat("weights", k["rope_sin"], table),
             _flat("kcache", (lh * k["ctx"] + first) * hd, count * hd),
             _flat("vcache", (lh * k["ctx"] + first) * hdv, count * hdv),
             _flat("vnow", lh * hdv, hdv)]
    writes = [_flat("act", act(k, "attn", layer) + (chunk * k["n_head"] + head * g) * rec, g * rec)]
    if chunk == 0:  # one fixed writer of the roped K row at the current position
        writes.append(_flat("know", lh * hd, hd))
    return reads, writes


def expected_outputs(op: int, layer: int, k: dict) -> list[Block]:
    """What the tasks of one (opcode, layer) must write together, each element exactly once."""
    e = k["n_embd"]
    lh = layer * k["n_head_kv"]
    table = {
        Op.EMBED: [_flat("act", act(k, "x", 0), e)],
        Op.QKV: [_flat("act", act(k, "qkv", layer), n_qkv(k)),
                         _flat("vnow", lh * k["head_dim_v"], k["n_head_kv"] * k["head_dim_v"])],
        Op.ATTN: [_flat("act", act(k, "attn", layer), k["attn_chunks"] * k["n_head"] * attn_record(k)),
                          _flat("know", lh * k["head_dim"], k["n_head_kv"] * k["head_dim"])],
        Op.WO: [_flat("act", act(k, "h", layer), e)],
        Op.FFN: [_flat("act", act(k, "ffn", layer), k["ffn_parts"] * e)],
        Op.FFN_REDUCE: [_flat("act", act(k, "x", layer + 1), e)],
        Op.FINAL_NORM: [_flat("act", act(k, "xn"), e)],
        Op.LM_HEAD: [_flat("act", act(k, "logits"), k["vocab"]), _flat("act", act(k, "cand"), 2 * k["lm_parts"])],
    }
    return table[Op(op)]


# ---- the checks ---------------------------------------------------------------------------------
def validate(plan, target: Target | None = None) -> None:
    """Raise PlanError naming the first problem found in `plan`; return None when it is sound."""
    k = plan.consts
    missing = [name for name in CONST_NAMES if name not in k]
    if missing:
        raise PlanError(f"plan constants lack {', '.join(missing)}")
    _check_fingerprint(plan, target or plan.target)
    tasks = plan.tasks
    if tasks.dtype != TASK_DTYPE:
        raise PlanError(f"task array of dtype {tasks.dtype}, expected the 64-byte task layout")
    if len(tasks) != k["n_tasks"]:
        raise PlanError(f"{len(tasks)} tasks, expected n_tasks = {k['n_tasks']}")
    if np.any(np.diff(tasks["wave"].astype(np.int64)) < 0):
        raise PlanError("tasks are not sorted by wave")
    _check_tensors(plan)
    ranges = [_checked_fields(plan, i) for i in range(len(tasks))]
    _check_bounds(plan, ranges)
    _check_dataflow(plan, ranges)
    _check_outputs(plan, ranges)


def describe(plan, i: int) -> str:
    t = plan.tasks[i]
    wave = int(t["wave"])
    name = plan.waves[wave]["name"] if wave < len(plan.waves) else "?"
    op = Op(t["opcode"]).name if int(t["opcode"]) in Op._value2member_map_ else str(int(t["opcode"]))
    return (f"task {i} ({op}, wave {wave} {name}, worker {int(t['worker'])}, layer {int(t['layer'])}, "
            f"rows {int(t['row_start'])}+{int(t['row_count'])})")


def _check_fingerprint(plan, target: Target) -> None:
    if plan.target != target:
        raise PlanError(f"plan made for target {plan.target}, expected {target}")
    want = fingerprint(target)["fingerprint"]
    found = plan.fingerprint.get("fingerprint")
    if found != want:
        raise PlanError(f"plan fingerprint {found}, expected {want} (this worker binary and plan_format.h)")


def _check_tensors(plan) -> None:
    size = plan.consts["weights_size"]
    slots = sorted(plan.tensors.values(), key=lambda s: s.offset)
    for slot in slots:
        if slot.offset < 0 or slot.offset + slot.n_bytes > size:
            raise PlanError(f"tensor {slot.name} at bytes {slot.offset}..{slot.offset + slot.n_bytes}, "
                            f"expected inside weights.bin of {size} bytes")
    for a, b in zip(slots, slots[1:]):
        if a.offset + a.n_bytes > b.offset:
            raise PlanError(f"tensors {a.name} (bytes {a.offset}..{a.offset + a.n_bytes}) and {b.name} "
                            f"(from byte {b.offset}) overlap in weights.bin")
    for i in range(plan.consts["n_layers"]):
        q, k, v = (plan.tensors.get(f"blk.{i}.attn_{x}.weight") for x in "qkv")
        if q and k and v and (q.offset + q.n_bytes != k.offset or k.offset + k.n_bytes != v.offset):
            raise PlanError(f"layer {i}: attn_q, attn_k, attn_v at {q.offset}, {k.offset}, {v.offset}, "
                            f"expected adjacent (one stacked QKV matrix)")


class _Where:
    """describe(plan, i), built only when an error message needs it."""

    def __init__(self, plan, i: int):
        self.plan, self.i = plan, i

    def __str__(self) -> str:
        return describe(self.plan, self.i)

    def __format__(self, spec: str) -> str:
        return str(self)


def _checked_fields(plan, i: int):
    t, k = plan.tasks[i], plan.consts
    where = _Where(plan, i)
    limits = {"wave": k["n_waves"], "worker": plan.target.workers, "layer": max(1, k["n_layers"])}
    for name, limit in limits.items():
        if int(t[name]) >= limit:
            raise PlanError(f"{where}: {name} {int(t[name])}, expected below {limit}")
    op = int(t["opcode"])
    if op not in Op._value2member_map_ or op == Op.NOP:
        raise PlanError(f"{where}: opcode {op}, expected 1..{max(Op).value}")
    if int(t["row_count"]) == 0:
        raise PlanError(f"{where}: no rows, expected row_count >= 1")
    slot_limit = {Op.FFN: k["ffn_parts"], Op.LM_HEAD: k["lm_parts"], Op.ATTN: k["attn_chunks"]}.get(Op(op))
    if slot_limit is not None and int(t["slot"]) >= slot_limit:
        raise PlanError(f"{where}: slot {int(t['slot'])}, expected below {slot_limit}")
    if op == Op.ATTN:
        _check_attn_fields(t, k, where)
    for name, tensor in _operand_tensors(Op(op), int(t["layer"]), plan.tensors).items():
        if int(t[name]) != (tensor.offset if tensor else 0):
            want = f"{tensor.offset} ({tensor.name})" if tensor else "0 (unused)"
            raise PlanError(f"{where}: {name} = {int(t[name])}, expected {want}")
    return task_ranges(t, k)


def _operand_tensors(op: Op, layer: int, tensors: dict) -> dict:
    """The tensor each offset field of an opcode must point at (None: the field must be 0)."""
    def blk(name: str):
        return tensors.get(f"blk.{layer}.{name}.weight")

    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    table = {
        Op.EMBED: (tensors.get("token_embd.weight"), None, None, None),
        Op.QKV: (blk("attn_q"), None, None, blk("attn_norm")),
        Op.ATTN: (None, None, None, None),
        Op.WO: (blk("attn_output"), None, None, None),
        Op.FFN: (blk("ffn_gate"), blk("ffn_up"), blk("ffn_down"), blk("ffn_norm")),
        Op.FFN_REDUCE: (None, None, None, None),
        Op.FINAL_NORM: (None, None, None, tensors.get("output_norm.weight")),
        Op.LM_HEAD: (head, None, None, None),
    }
    return dict(zip(("weight0", "weight1", "weight2", "norm"), table[op]))


def _check_attn_fields(t, k: dict, where: _Where) -> None:
    if int(t["head"]) >= k["n_head_kv"]:
        raise PlanError(f"{where}: K/V head {int(t['head'])}, expected below {k['n_head_kv']}")
    want = (int(t["slot"]) * k["attn_chunk"], k["attn_chunk"])
    if (int(t["row_start"]), int(t["row_count"])) != want:
        raise PlanError(f"{where}: positions {int(t['row_start'])}+{int(t['row_count'])}, expected "
                        f"{want[0]}+{want[1]} for chunk {int(t['slot'])} of {k['attn_chunk']} positions")


def _check_bounds(plan, ranges) -> None:
    sizes = buffer_sizes(plan.consts)
    for i, (reads, writes) in enumerate(ranges):
        for kind, blocks in (("reads", reads), ("writes", writes)):
            for b in blocks:
                if b.start < 0 or b.end > sizes[b.buf] or b.row_len > b.stride and b.rows > 1:
                    raise PlanError(f"{describe(plan, i)} {kind} {b}, expected inside {b.buf} of {sizes[b.buf]}")
        for b in writes:
            if b.buf in READ_ONLY:
                raise PlanError(f"{describe(plan, i)} writes {b}, but {b.buf} is read-only during a token")


def _view(array: np.ndarray, b: Block) -> np.ndarray:
    """The elements of block b as a (rows, row_len) view of `array` (bounds already checked)."""
    if b.rows == 1:
        return array[b.start:b.start + b.row_len][None, :]
    base = array[b.start:]
    return as_strided(base, shape=(b.rows, b.row_len), strides=(b.stride * array.itemsize, array.itemsize))


def _check_outputs(plan, ranges) -> None:
    """Each (opcode, layer) writes inside its output and as many elements as it has: with one
    writer per element (checked before), that is every element exactly once."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, t in enumerate(plan.tasks):
        groups[(int(t["opcode"]), int(t["layer"]))].append(i)
    for (op, layer), members in groups.items():
        wanted = expected_outputs(op, layer, plan.consts)
        written = 0
        for i in members:
            for b in ranges[i][1]:
                if not any(w.buf == b.buf and w.start <= b.start and b.end <= w.end for w in wanted):
                    raise PlanError(f"{describe(plan, i)} writes {b}, expected inside "
                                    f"{' or '.join(str(w) for w in wanted)}")
                written += b.rows * b.row_len
        expected = sum(w.row_len for w in wanted)
        if written != expected:
            raise PlanError(f"{Op(op).name} layer {layer}: tasks {members[0]}..{members[-1]} write {written} "
                            f"elements, expected all {expected} of {' and '.join(str(w) for w in wanted)}")


def _check_dataflow(plan, ranges) -> None:
    """Every element is written at most once per token; every read sees a write of an earlier wave."""
    sizes = buffer_sizes(plan.consts)
    tracked = ("act", "know", "vnow")
    wave_of = {b: np.full(sizes[b], -1, dtype=np.int32) for b in tracked}
    writer = {b: np.full(sizes[b], -1, dtype=np.int32) for b in tracked}
    for i, t in enumerate(plan.tasks):
        for b in ranges[i][1]:
            taken = _view(writer[b.buf], b)
            if np.any(taken >= 0):
                other = int(taken[taken >= 0][0])
                raise PlanError(f"{describe(plan, i)} writes {b}, which {describe(plan, other)} also writes: "
                                f"expected one writer per element in a token")
            taken[:] = i
            _view(wave_of[b.buf], b)[:] = int(t["wave"])
    waves = plan.tasks["wave"]
    bounds = np.searchsorted(waves, np.arange(plan.consts["n_waves"] + 1))
    for w in range(plan.consts["n_waves"]):
        if bounds[w] == bounds[w + 1]:
            raise PlanError(f"wave {w} ({plan.waves[w]['name']}) has no task, expected at least one")
    for i, t in enumerate(plan.tasks):
        for b in ranges[i][0]:
            if b.buf in tracked:
                _check_read(plan, i, int(t["wave"]), b, wave_of[b.buf], writer[b.buf])


def _check_read(plan, i: int, w: int, b: Block, wave_of: np.ndarray, writer: np.ndarray) -> None:
    seen = _view(wave_of, b)
    if np.all((seen >= 0) & (seen < w)):
        return
    if np.any(seen < 0):
        raise PlanError(f"{describe(plan, i)} reads {b} in wave {w}, part of which no task writes")
    late = seen >= w
    other = int(_view(writer, b)[late][0])
    when = "the same wave" if int(seen[late][0]) == w else f"the later wave {int(seen[late][0])}"
    raise PlanError(f"{describe(plan, i)} reads {b}, which {describe(plan, other)} writes in {when}: "
                    f"expected it to be written by an earlier wave")
