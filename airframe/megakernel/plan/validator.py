"""The plan validator: runs before every launch and on every package load.

Each task's reads and writes are derived from its opcode and fields (`task_ranges`) as blocks of
rows in named buffers. The checks:
  - every block lies inside its buffer, and nothing writes the read-only buffers;
  - within a wave no two tasks write the same element, and each (opcode, layer) writes its whole
    output exactly once; split-K pieces of a row tile its columns (the first piece to qkv / h,
    the second to the side vector) and the FFN tasks of a layer cover every (FFN row, output row)
    pair exactly once;
  - every read of the activation arena or of the current position's K/V rows was written by an
    earlier wave of the same token: never by its own wave, never only by a later one;
  - the plan was made for this target and this plan_format.h (the fingerprint).
The K/V caches are two buffers each: the past (positions < p, read-only within a token, bounded by
the chunk envelopes for every p < ctx) and the row at the current position p ("know", "vnow").
Side vectors and FFN partial slots are "sparse": an element no task writes stays zero from the
upload, so a read of one needs only the elements that are written to come from an earlier wave.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...errors import AirframeError
from .opcodes import CONST_NAMES, TASK_DTYPE, Op
from .planner import Q8_BLOCK, q8_down_block_bytes, row_bytes
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
    sparse: bool = False  # elements no task writes read as zero

    @property
    def end(self) -> int:  # one past the last element touched
        return self.start + (self.rows - 1) * self.stride + self.row_len if self.rows and self.row_len else self.start

    def __str__(self) -> str:
        if self.rows == 1:
            return f"{self.buf}[{self.start}:{self.start + self.row_len}]"
        return f"{self.buf}[{self.start}:{self.end}] ({self.rows} rows of {self.row_len}, stride {self.stride})"


def _flat(buf: str, start: int, length: int, sparse: bool = False) -> Block:
    return Block(buf, start, 1, length, length, sparse)


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
    """Arena offset of an activation: "x" (x[layer]), "qkv", "attn", "h", "qkv_side", "h_side",
    "ffn" (of a layer), or "xn", "logits", "cand"."""
    if name == "x":
        return k["act_x"] + layer * k["act_x_stride"]
    if name in ("qkv", "attn", "h", "qkv_side", "h_side", "ffn"):
        return k["act_layer"] + layer * k["act_layer_size"] + k[f"lay_{name}"]
    return k[f"act_{name}"]


def task_ranges(t, k: dict) -> tuple[list[Block], list[Block]]:
    """(reads, writes) of one task, as blocks; weights in bytes, everything else in floats."""
    op, r0, n, layer = int(t["opcode"]), int(t["row_start"]), int(t["row_count"]), int(t["layer"])
    e = k["n_embd"]
    fmt = "q8_0" if k["weights_q8"] else "bf16"
    if op == Op.EMBED:
        table = k["vocab"] * row_bytes(fmt, e)  # the token's row is chosen at run time: the whole table is the envelope
        return [_flat("weights", int(t["weight0"]), table)], [_flat("act", act(k, "x", 0) + r0, n)]
    if op == Op.QKV:
        reads = [_flat("act", act(k, "x", layer), e), _flat("weights", int(t["norm"]), e * 4),
                 _piece_block(t, e, fmt)]
        return reads, [_flat("act", act(k, "qkv_side" if int(t["side"]) else "qkv", layer) + r0, n)]
    if op == Op.ATTN:
        return _attn_ranges(t, k)
    if op == Op.WO:
        n_in = k["n_head"] * k["head_dim_v"]
        reads = [_flat("act", act(k, "attn", layer), k["attn_chunks"] * k["n_head"] * attn_record(k)),
                 _piece_block(t, n_in, fmt)]
        if int(t["side"]):
            return reads, [_flat("act", act(k, "h_side", layer) + r0, n)]
        return reads + [_flat("act", act(k, "x", layer) + r0, n)], [_flat("act", act(k, "h", layer) + r0, n)]
    if op == Op.FFN:
        p0, pn = int(t["part_start"]), int(t["part_count"])
        reads = [_flat("act", act(k, "h", layer), e), _flat("act", act(k, "h_side", layer), e, sparse=True),
                 _flat("weights", int(t["norm"]), e * 4)]
        row = row_bytes(fmt, e)
        reads += [_flat("weights", int(t[w]) + r0 * row, n * row) for w in ("weight0", "weight1")]
        if fmt == "q8_0":  # the 32-row blocks of the transposed ffn_down that hold the task's rows
            first, last = r0 // Q8_BLOCK, -(-(r0 + n) // Q8_BLOCK)
            block = q8_down_block_bytes(e)
            reads.append(_flat("weights", int(t["weight2"]) + first * block, (last - first) * block))
        else:
            reads.append(Block("weights", int(t["weight2"]) + (r0 * e + p0) * 2, n, pn * 2, e * 2))
        return reads, [_flat("act", act(k, "ffn", layer) + int(t["slot"]) * e + p0, pn)]
    if op == Op.FFN_REDUCE:
        parts = Block("act", act(k, "ffn", layer) + r0, k["ffn_parts"], n, e, sparse=True)
        reads = [parts, _flat("act", act(k, "h", layer) + r0, n), _flat("act", act(k, "h_side", layer) + r0, n, True)]
        return reads, [_flat("act", act(k, "x", layer + 1) + r0, n)]
    if op == Op.FINAL_NORM:
        reads = [_flat("act", act(k, "x", k["n_layers"]), e), _flat("weights", int(t["norm"]), e * 4)]
        return reads, [_flat("act", act(k, "xn") + r0, n)]
    if op == Op.LM_HEAD:
        row = row_bytes(fmt, e)
        reads = [_flat("act", act(k, "xn"), e), _flat("weights", int(t["weight0"]) + r0 * row, n * row)]
        return reads, [_flat("act", act(k, "logits") + r0, n), _flat("act", act(k, "cand") + 2 * int(t["slot"]), 2)]
    raise PlanError(f"opcode {op}, expected one of {', '.join(f'{o.value} {o.name}' for o in Op if o)}")


def _piece_block(t, cols: int, fmt: str) -> Block:
    """The weight bytes of a QKV/WO task: its rows, columns [part_start, +part_count) (in Q8_0 the
    whole rows: a piece's scales lie past the row's quants)."""
    r0, n, p0, pn = int(t["row_start"]), int(t["row_count"]), int(t["part_start"]), int(t["part_count"])
    if fmt == "q8_0":
        row = row_bytes(fmt, cols)
        return _flat("weights", int(t["weight0"]) + r0 * row, n * row)
    return Block("weights", int(t["weight0"]) + (r0 * cols + p0) * 2, n, pn * 2, cols * 2)


def head_qkv_rows(k: dict, head: int) -> tuple[tuple[int, int], ...]:
    """(first row, rows) of the q rows of K/V head `head`'s query heads, of its k rows and of its
    v rows in the stacked QKV output: what one attention task reads."""
    hd, hdv, g = k["head_dim"], k["head_dim_v"], k["n_head"] // k["n_head_kv"]
    return ((head * g * hd, g * hd), (k["n_head"] * hd + head * hd, hd),
            ((k["n_head"] + k["n_head_kv"]) * hd + head * hdv, hdv))


def _attn_ranges(t, k: dict) -> tuple[list[Block], list[Block]]:
    layer, head, chunk = int(t["layer"]), int(t["head"]), int(t["slot"])
    hd, hdv, g = k["head_dim"], k["head_dim_v"], k["n_head"] // k["n_head_kv"]
    first = int(t["row_start"])
    count = max(0, min(int(t["row_count"]), k["ctx"] - first))
    if k["attn_spread"]:  # a chunk's positions move with the position (attn_span): any cached row
        first, count = 0, k["ctx"]
    lh = layer * k["n_head_kv"] + head
    rec = attn_record(k)
    table = k["ctx"] * (k["rope_dim"] // 2) * 4
    reads = [_flat("weights", k["rope_cos"], table), _flat("weights", k["rope_sin"], table),
             _flat("kcache", (lh * k["ctx"] + first) * hd, count * hd),
             _flat("vcache", (lh * k["ctx"] + first) * hdv, count * hdv)]
    for name, sparse in (("qkv", False), ("qkv_side", True)):  # this head's q, k and v rows
        base = act(k, name, layer)
        reads += [_flat("act", base + start, n, sparse) for start, n in head_qkv_rows(k, head)]
    writes = [_flat("act", act(k, "attn", layer) + (chunk * k["n_head"] + head * g) * rec, g * rec)]
    if chunk == 0:  # one fixed writer of the current position's roped K row and V row
        writes += [_flat("know", lh * hd, hd), _flat("vnow", lh * hdv, hdv)]
    return reads, writes


def expected_outputs(op: int, layer: int, k: dict) -> tuple[list[Block], list[Block]]:
    """(dense, sparse): what the tasks of one (opcode, layer) must write together, each dense
    element exactly once, and where else they may write (at most once per element)."""
    e = k["n_embd"]
    lh = layer * k["n_head_kv"]
    dense = {
        Op.EMBED: [_flat("act", act(k, "x", 0), e)],
        Op.QKV: [_flat("act", act(k, "qkv", layer), n_qkv(k))],
        Op.ATTN: [_flat("act", act(k, "attn", layer), k["attn_chunks"] * k["n_head"] * attn_record(k)),
                  _flat("know", lh * k["head_dim"], k["n_head_kv"] * k["head_dim"]),
                  _flat("vnow", lh * k["head_dim_v"], k["n_head_kv"] * k["head_dim_v"])],
        Op.WO: [_flat("act", act(k, "h", layer), e)],
        Op.FFN: [],
        Op.FFN_REDUCE: [_flat("act", act(k, "x", layer + 1), e)],
        Op.FINAL_NORM: [_flat("act", act(k, "xn"), e)],
        Op.LM_HEAD: [_flat("act", act(k, "logits"), k["vocab"]), _flat("act", act(k, "cand"), 2 * k["lm_parts"])],
    }
    sparse = {
        Op.QKV: [_flat("act", act(k, "qkv_side", layer), n_qkv(k), True)],
        Op.WO: [_flat("act", act(k, "h_side", layer), e, True)],
        Op.FFN: [_flat("act", act(k, "ffn", layer), k["ffn_parts"] * e, True)],  # coverage: _check_pieces
    }
    return dense[Op(op)], sparse.get(Op(op), [])


# ---- the checks ---------------------------------------------------------------------------------
def validate(plan, target: Target | None = None) -> None:
    """Raise PlanError naming the first problem found in `plan`; return None when it is sound."""
    k = plan.consts
    missing = [name for name in CONST_NAMES if name not in k]
    if missing:
        raise PlanError(f"plan constants lack {', '.join(missing)}")
    _check_fingerprint(plan, target or plan.target)
    if k["attn_spread"] and k["attn_min"] < 1:
        raise PlanError(f"attn_min {k['attn_min']}: with attn_spread it must be at least 1")
    if k["attn_spread"] and k["attn_wide"] and k["attn_wide_min"] < 1:
        raise PlanError(f"attn_wide_min {k['attn_wide_min']}: with attn_wide it must be at least 1")
    tasks = plan.tasks
    if tasks.dtype != TASK_DTYPE:
        raise PlanError(f"task array of dtype {tasks.dtype}, expected the {TASK_DTYPE.itemsize}-byte task layout")
    if len(tasks) != k["n_tasks"]:
        raise PlanError(f"{len(tasks)} tasks, expected n_tasks = {k['n_tasks']}")
    if np.any(np.diff(tasks["wave"].astype(np.int64)) < 0):
        raise PlanError("tasks are not sorted by wave")
    _check_tensors(plan)
    ranges = [_checked_fields(plan, i) for i in range(len(tasks))]
    _check_bounds(plan, ranges)
    _check_dataflow(plan, ranges)
    _check_outputs(plan, ranges)
    _check_pieces(plan)


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
    fmt = "q8_0" if plan.consts["weights_q8"] else "bf16"
    for slot in slots:
        if len(slot.shape) == 2 and not slot.name.startswith("rope_") and slot.dtype != fmt:
            raise PlanError(f"tensor {slot.name} stored as {slot.dtype}, expected {fmt} "
                            f"(weights_q8 = {plan.consts['weights_q8']})")
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
    _check_part_fields(t, k, where)
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


def _part_width(op: int, k: dict) -> int:
    """The dimension part_start/part_count cut: QKV and WO columns, FFN output rows; 0: unused."""
    return {Op.QKV: k["n_embd"], Op.WO: k["n_head"] * k["head_dim_v"], Op.FFN: k["n_embd"]}.get(Op(op), 0)


def _check_part_fields(t, k: dict, where: _Where) -> None:
    op, p0, pn, side = int(t["opcode"]), int(t["part_start"]), int(t["part_count"]), int(t["side"])
    width, vec = _part_width(op, k), k["dot_vec"]
    if int(t["pad"]):
        raise PlanError(f"{where}: pad {int(t['pad'])}, expected 0")
    if not width:
        if p0 or pn or side:
            raise PlanError(f"{where}: part {p0}+{pn}, side {side}, expected 0 for {Op(op).name}")
        return
    if pn == 0 or p0 + pn > width or p0 % vec or pn % vec:
        raise PlanError(f"{where}: part {p0}+{pn}, expected a non-empty run of multiples of {vec} inside 0..{width}")
    if side > 1 or (side and (op == Op.FFN or p0 == 0)):
        raise PlanError(f"{where}: side {side} with part {p0}+{pn}, expected 1 only for a QKV/WO piece "
                        f"that does not start a row, else 0")
    if op != Op.FFN and pn < width and int(t["row_count"]) != 1:
        raise PlanError(f"{where}: a split-K piece over {int(t['row_count'])} rows, expected one row")


def _check_pieces(plan) -> None:
    """Per (QKV/WO/FFN, layer): every row's parts tile 0..width exactly. For QKV and WO that is the
    row's split-K pieces (the one from column 0 is the non-side one, checked with the fields);
    for the FFN, the output rows of each FFN row's ffn_down column."""
    k, tasks = plan.consts, plan.tasks
    rows_of = {Op.QKV: n_qkv(k), Op.WO: k["n_embd"], Op.FFN: k["n_ff"]}
    for op, rows in rows_of.items():
        width = _part_width(op, k)
        for layer in range(k["n_layers"]):
            members = np.flatnonzero((tasks["opcode"] == op) & (tasks["layer"] == layer))
            cover = np.zeros(rows, dtype=np.int64)
            pieces: dict[int, list] = defaultdict(list)
            for i in members:
                t = tasks[i]
                r0, n, p0, pn = (int(t[f]) for f in ("row_start", "row_count", "part_start", "part_count"))
                cover[r0:r0 + n] += pn
                if pn < width:
                    for r in range(r0, r0 + n):
                        pieces[r].append((p0, pn, int(i)))
            bad = np.flatnonzero(cover != width)
            if bad.size:
                r = int(bad[0])
                raise PlanError(f"{Op(op).name} layer {layer}: row {r} has {int(cover[r])} of its {width} "
                                f"parts covered, expected each exactly once")
            for r, parts in pieces.items():
                at = 0
                for p0, pn, i in sorted(parts):
                    if p0 != at:
                        raise PlanError(f"{describe(plan, i)}: part {p0}+{pn} of row {r}, expected it to start at "
                                        f"{at} (the row's parts must tile 0..{width})")
                    at = p0 + pn


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
    """Each (opcode, layer) writes inside its outputs and as many dense elements as there are: with
    one writer per element (checked before), that is every dense element exactly once."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, t in enumerate(plan.tasks):
        groups[(int(t["opcode"]), int(t["layer"]))].append(i)
    for (op, layer), members in groups.items():
        dense, sparse = expected_outputs(op, layer, plan.consts)
        written = 0
        for i in members:
            for b in ranges[i][1]:
                inside = [w for w in dense + sparse if w.buf == b.buf and w.start <= b.start and b.end <= w.end]
                if not inside:
                    raise PlanError(f"{describe(plan, i)} writes {b}, expected inside "
                                    f"{' or '.join(str(w) for w in dense + sparse)}")
                if not inside[0].sparse:
                    written += b.rows * b.row_len
        expected = sum(w.row_len for w in dense)
        if written != expected:
            raise PlanError(f"{Op(op).name} layer {layer}: tasks {members[0]}..{members[-1]} write {written} "
                            f"elements, expected all {expected} of {' and '.join(str(w) for w in dense)}")


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
    unwritten_ok = b.sparse  # those elements hold the upload's zeros
    if np.all(((seen >= 0) | unwritten_ok) & (seen < w)):
        return
    if not unwritten_ok and np.any(seen < 0):
        raise PlanError(f"{describe(plan, i)} reads {b} in wave {w}, part of which no task writes")
    late = seen >= w
    other = int(_view(writer, b)[late][0])
    when = "the same wave" if int(seen[late][0]) == w else f"the later wave {int(seen[late][0])}"
    raise PlanError(f"{describe(plan, i)} reads {b}, which {describe(plan, other)} writes in {when}: "
                    f"expected it to be written by an earlier wave")
