"""The one source of truth for the megakernel plan format: opcodes, the task word, plan constants.

Everything the CUDA worker needs to decode a plan is declared here as data. `render_header()`
turns these tables into `cuda/plan_format.h`; `python -m airframe.megakernel.plan.opcodes`
rewrites that file, and a test fails when the committed header is out of date. Never edit the
header by hand.

A task is 80 bytes (little-endian): eight u32 fields, four u64 byte offsets into `weights.bin`,
then four u32 fields of the split-K extension. What each field means per opcode is in
docs/MEGAKERNEL.md and in OPCODE_DOCS.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import astuple, field, make_dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

PLAN_VERSION = 5
# the worker includes it, so it lives beside the worker sources
HEADER_PATH = Path(__file__).resolve().parents[1] / "cuda" / "plan_format.h"


class Op(IntEnum):
    NOP = 0
    EMBED = 1
    QKV = 2
    ATTN = 3
    WO = 4
    FFN = 5
    FFN_REDUCE = 6
    FINAL_NORM = 7
    LM_HEAD = 8


OPCODE_DOCS = {
    Op.NOP: "does nothing (padding)",
    Op.EMBED: "x[0][rows] = token_embd[token, rows] * embed_scale",
    Op.QKV: "qkv[rows] (side: qkv_side[rows]) = W_qkv[rows, part] . rmsnorm(x[layer], norm)[part]",
    Op.ATTN: "one K/V head, one chunk of positions: RoPE on Q and K (of qkv + qkv_side), flash-decoding "
             "partial (m, l, o) per query head; chunk 0 writes the roped K and the V row to the caches at pos",
    Op.WO: "h[rows] = x[layer][rows] + W_o[rows, part] . merge(attention partials)[part] "
           "(side: h_side[rows], no residual)",
    Op.FFN: "ffn[slot][part] = down[part, rows] . (silu(gate[rows] . n) * (up[rows] . n)), "
            "n = rmsnorm(h + h_side, norm)",
    Op.FFN_REDUCE: "x[layer+1][rows] = (h + h_side)[rows] + the exact sum over slots of ffn[k][rows] "
                   "(64-bit fixed point, 2^-32 units, rounded once)",
    Op.FINAL_NORM: "xn[rows] = rmsnorm(x[n_layers], norm)[rows]",
    Op.LM_HEAD: "logits[rows] = W_out[rows] . xn; cand[slot] = (largest logit, lowest id among ties)",
}

# (name, type, meaning); the order is the layout. u64 fields sit on 8-byte boundaries.
TASK_FIELDS = (
    ("opcode", "u32", "one of AF_OP_*"),
    ("wave", "u32", "wave index; waves run in order, a grid barrier after each"),
    ("worker", "u32", "the worker (persistent block) that runs the task"),
    ("layer", "u32", "decoder layer; 0 for the global opcodes"),
    ("row_start", "u32", "first output row (ATTN: first position of the chunk)"),
    ("row_count", "u32", "output rows (ATTN: positions in a full chunk)"),
    ("slot", "u32", "FFN: partial slot; LM_HEAD: candidate slot; ATTN: chunk index"),
    ("head", "u32", "ATTN: K/V head; 0 otherwise"),
    ("weight0", "u64", "byte offset in weights.bin: EMBED token_embd, QKV attn_q (q, k, v stacked), "
                       "WO attn_output, FFN ffn_gate, LM_HEAD output (or token_embd)"),
    ("weight1", "u64", "FFN: ffn_up; 0 otherwise"),
    ("weight2", "u64", "FFN: ffn_down stored transposed (n_ff rows of n_embd); 0 otherwise"),
    ("norm", "u64", "byte offset of the F32 norm weight (QKV, FFN, FINAL_NORM); 0 otherwise"),
    ("part_start", "u32", "QKV, WO: first column multiplied (a split-K piece when not the whole row); "
                          "FFN: first output row of its ffn_down columns; 0 otherwise"),
    ("part_count", "u32", "QKV, WO: columns multiplied (whole rows: all K); FFN: output rows (whole: n_embd); "
                          "0 otherwise"),
    ("side", "u32", "QKV, WO: 1 = write the rows to the layer's side vector (qkv_side, h_side; no residual) "
                    "instead of qkv / h; 0 otherwise"),
    ("pad", "u32", "0"),
)

# Plan constants: plan.json "consts" holds exactly these keys; the header declares a struct in
# this order so the runtime can upload them as one block.
PLAN_CONSTS = (
    ("n_layers", "u32", "decoder layers"),
    ("n_embd", "u32", "hidden width"),
    ("n_head", "u32", "query heads"),
    ("n_head_kv", "u32", "K/V heads"),
    ("head_dim", "u32", "Q/K head width"),
    ("head_dim_v", "u32", "V head width"),
    ("rope_dim", "u32", "rotated dims per head"),
    ("rope_neox", "u32", "0: pairs (2i, 2i+1); 1: pairs (i, i + rope_dim/2)"),
    ("n_ff", "u32", "FFN intermediate width"),
    ("vocab", "u32", "vocabulary size (logits)"),
    ("ctx", "u32", "K/V cache capacity in positions"),
    ("attn_chunk", "u32", "most positions per attention chunk C (the scratch of one attention task)"),
    ("attn_chunks", "u32", "chunks planned = ceil(ctx / C)"),
    ("attn_spread", "u32", "0: chunk c holds [c*C, (c+1)*C) at every position; s > 0: at position p, k = min(s, "
                           "attn_chunks, (p + 1) / attn_min) chunks, or with attn_wide w > 0 k = max(k, min(w, "
                           "attn_chunks, (p + 1) / attn_wide_min)), share the p + 1 positions when k >= 3, "
                           "attn_span(p) = min(C, ceil((p + 1) / k)) each, chunk c holding [c * span, (c + 1) * "
                           "span); with k < 3, span C. Active at p: p / span + 1"),
    ("attn_min", "u32", "with attn_spread: the fewest positions a chunk is given when a context is spread"),
    ("attn_wide", "u32", "with attn_spread: the most chunks a longer context is spread over (0: attn_spread's)"),
    ("attn_wide_min", "u32", "with attn_wide: the fewest positions each of those chunks is given"),
    ("ffn_parts", "u32", "FFN partial slots per layer, all summed by FFN_REDUCE (exactly, in fixed point); a "
                         "slot written only in part (a split FFN task's output rows) is zero elsewhere"),
    ("lm_parts", "u32", "LM_HEAD candidate slots"),
    ("dot_lanes", "u32", "lanes of the fixed dot-product order"),
    ("dot_vec", "u32", "consecutive elements per lane step"),
    ("n_tasks", "u32", "tasks in tasks.bin"),
    ("n_waves", "u32", "waves per token"),
    ("act_x", "u32", "F32 arena offset of x[0..n_layers]: x[0] embedding, x[l+1] output of layer l"),
    ("act_x_stride", "u32", "floats between x[l] and x[l+1]"),
    ("act_layer", "u32", "F32 arena offset of layer 0's block; layer l's is act_layer + l * act_layer_size"),
    ("act_layer_size", "u32", "floats per layer block"),
    ("lay_qkv", "u32", "in a layer block: q, k, v before RoPE (n_q + n_kv + n_kv_v)"),
    ("lay_attn", "u32", "in a layer block: partials [chunk][q head][m, l, o[head_dim_v]]"),
    ("lay_h", "u32", "in a layer block: residual stream after attention (n_embd)"),
    ("lay_qkv_side", "u32", "in a layer block: second split-K pieces of qkv rows; zero where no row is split"),
    ("lay_h_side", "u32", "in a layer block: second split-K pieces of h rows; zero where no row is split"),
    ("lay_ffn", "u32", "in a layer block: FFN partials [slot][n_embd]"),
    ("act_xn", "u32", "F32 arena offset: final-normed hidden state (n_embd)"),
    ("act_logits", "u32", "F32 arena offset: logits (vocab)"),
    ("act_cand", "u32", "F32 arena offset: [slot][value f32, id u32 bits]"),
    ("act_size", "u32", "F32 arena size in elements"),
    ("rms_eps", "f32", "RMSNorm epsilon"),
    ("attn_scale", "f32", "score scale, 1/sqrt(head_dim)"),
    ("embed_scale", "f32", "embedding multiplier"),
    ("weights_q8", "u32", "0: matrices in BF16; 1: every matrix in Q8_0 (planner.WEIGHT_FORMATS), for a worker built with AF_Q8"),
    ("rope_cos", "u64", "byte offset of the F32 table cos[ctx][rope_dim/2]"),
    ("rope_sin", "u64", "byte offset of the F32 table sin[ctx][rope_dim/2]"),
    ("weights_size", "u64", "bytes in weights.bin"),
)


def attn_span(k: dict, pos: int) -> int:
    """Positions per attention chunk at position `pos` (the rule of attn_spread above; the worker's
    attn_span in worker_base.cuh is the same arithmetic). Chunk c covers [c * span, min((c + 1) *
    span, pos + 1)) and runs when c * span <= pos. A context is spread over three chunks or more,
    never two: measured on the H200, splitting in two costs the WO merge more than it saves in the
    attention (docs/MEGAKERNEL.md, "Decisions and their evidence"). Up to attn_spread chunks of
    attn_min positions or more; past that, up to attn_wide chunks of attn_wide_min or more, where
    the attention saved pays for the costlier merge of more than four chunks."""
    if k["attn_spread"] == 0:
        return k["attn_chunk"]
    n = pos + 1
    chunks = min(k["attn_spread"], k["attn_chunks"], n // k["attn_min"])
    if k["attn_wide"]:
        chunks = max(chunks, min(k["attn_wide"], k["attn_chunks"], n // k["attn_wide_min"]))
    if chunks < 3:
        return k["attn_chunk"]
    return min(k["attn_chunk"], -(-n // chunks))


def attn_chunk_positions(k: dict, chunk: int, pos: int) -> tuple[int, int]:
    """[first, last): the positions attention chunk `chunk` covers at `pos` (first > pos: the chunk
    does not run there, and first == last)."""
    span = attn_span(k, pos)
    first = chunk * span
    return first, max(first, min(first + span, pos + 1))


_NUMPY = {"u32": "<u4", "u64": "<u8", "f32": "<f4"}
_C = {"u32": "uint32_t", "u64": "uint64_t", "f32": "float"}

TASK_DTYPE = np.dtype([(name, _NUMPY[kind]) for name, kind, _ in TASK_FIELDS])
TASK_BYTES = TASK_DTYPE.itemsize
TASK_WORDS = TASK_BYTES // 4
assert TASK_BYTES == 80, TASK_BYTES
CONST_NAMES = tuple(name for name, _, _ in PLAN_CONSTS)

# One task as a Python object, its fields generated from TASK_FIELDS (so they cannot drift).
Task = make_dataclass("Task", [(name, int, field(default=0)) for name, _, _ in TASK_FIELDS], frozen=True)
Task.__doc__ = "One task word: fields and their order are opcodes.TASK_FIELDS."


def tasks_to_array(tasks) -> np.ndarray:
    """Task objects -> the tasks.bin array (TASK_DTYPE)."""
    return np.array([astuple(t) for t in tasks], dtype=TASK_DTYPE)


def task_from_word(word) -> Task:
    """One TASK_DTYPE element -> a Task."""
    return Task(*(int(word[name]) for name in TASK_DTYPE.names))


def render_header() -> str:
    """The text of plan_format.h, generated from the tables above."""
    lines = [
        "// plan_format.h: the megakernel plan format, generated by airframe/megakernel/plan/opcodes.py.",
        "// Do not edit: run `python -m airframe.megakernel.plan.opcodes` after changing that file.",
        "#pragma once",
        "#ifdef __CUDACC_RTC__  // NVRTC has no C library headers: the fixed-width types used here",
        "typedef unsigned char uint8_t;",
        "typedef unsigned short uint16_t;",
        "typedef unsigned int uint32_t;",
        "typedef unsigned long long uint64_t;",
        "#else",
        "#include <stdint.h>",
        "#endif",
        "",
        f"#define AF_PLAN_VERSION {PLAN_VERSION}",
        f"#define AF_TASK_BYTES {TASK_BYTES}",
        "",
        "enum af_opcode : uint32_t {",
    ]
    for op in Op:
        lines.append(f"    AF_OP_{op.name} = {op.value},  // {OPCODE_DOCS[op]}")
    lines += ["};", "", f"// One task: {TASK_BYTES} bytes, little-endian, in tasks.bin sorted by (wave, worker).",
              "struct af_task {"]
    for name, kind, doc in TASK_FIELDS:
        lines.append(f"    {_C[kind]} {name};  // {doc}")
    lines += ["};", "static_assert(sizeof(af_task) == AF_TASK_BYTES, \"task layout\");", ""]
    offset = 0
    for name, kind, _ in TASK_FIELDS:
        lines.append(f"static_assert(__builtin_offsetof(af_task, {name}) == {offset}, \"{name}\");")
        offset += int(_NUMPY[kind][-1])
    lines += ["", "// Plan constants, the \"consts\" of plan.json in this order.", "struct af_plan_consts {"]
    for name, kind, doc in PLAN_CONSTS:
        lines.append(f"    {_C[kind]} {name};  // {doc}")
    lines += ["};", ""]
    return "\n".join(lines)


def header_sha256(text: str | None = None) -> str:
    return hashlib.sha256((render_header() if text is None else text).encode()).hexdigest()


def write_header(path: Path = HEADER_PATH) -> Path:
    path.write_text(render_header())
    return path


if __name__ == "__main__":
    print(write_header(Path(sys.argv[1]) if len(sys.argv) > 1 else HEADER_PATH))
