"""The planner: one decode token cut into tasks, each on a fixed worker, in waves between barriers.

Llama layout, waves per token: embed, then per layer qkv, attn, wo, ffn, ffn_reduce, then
final_norm and lm_head (1 + 5 * n_layers + 2). Attention is flash-decoding: each (K/V head,
chunk) task writes a partial (max, sum, weighted values) and the WO tasks merge the active
chunks, so no barrier sits between scores and values. Weight waves split rows evenly over the
workers; every row of a matrix is the same number of bytes, so equal rows are equal bytes. Where
whole rows are too coarse for that (more than SPLIT_LIMIT apart: 3,072 QKV rows over 132 H200
workers are 23 or 24 rows), `split=True` cuts finer:
  - QKV and WO (split-K): the rows x (cols / SPLIT_COLS) pieces are dealt out in contiguous runs,
    so a worker's run may start or end inside a row. A row cut in two has its first columns'
    piece written to qkv / h as usual and the rest to the layer's side vector (qkv_side, h_side),
    which stays zero wherever no row is cut; every consumer reads qkv + qkv_side and h + h_side.
  - FFN: every worker takes n_ff // workers intermediate rows; each of the n_ff % workers rows
    left over is shared by s workers, each computing its gate and up rows (the only redundant
    bytes) and 1/s of its ffn_down column, into partial slots of their own beyond the workers'.

The plan is made for a maximum context `ctx` (the K/V cache size) and is valid at every position
p < ctx: chunk c covers positions [c*C, min((c+1)*C, p+1)) and runs only when c*C <= p.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from ...errors import UnsupportedError
from ...family import ModelConfig
from ...rope_scaling import RopeScaling
from .opcodes import CONST_NAMES, PLAN_VERSION, Op, Task, attn_chunk_positions, tasks_to_array
from .target import Target, fingerprint

ALIGN = 256  # byte alignment of every tensor in weights.bin and of every arena region (in floats / 4)
DOT_LANES = 32
DOT_VEC = 8
DEFAULT_CTX = 4096
SPLIT_LIMIT = 0.01  # a weight wave whose whole rows are more uneven than this (max / mean - 1) is cut finer
SPLIT_COLS = 8      # split-K pieces start and end on multiples of this many columns (16 bytes)
# Whole rows by default: the worker runs split plans correctly but slower (it runs a worker's
# pieces of a wave as separate latency chains; 1.231 against 1.022 ms/token on the H200).
SPLIT_DEFAULT = False
# Attention below full context: the positions are spread over up to this many chunks (so that a
# context of a few hundred positions runs as several short attention tasks, not one long one),
# each given at least ATTN_MIN positions, three chunks at the least (opcodes.attn_span). Four keeps
# the WO merge to one round trip of loads (the worker's merge_few).
ATTN_SPREAD = 4
ATTN_MIN = 32
# Longer contexts: up to ATTN_WIDE chunks of at least ATTN_WIDE_MIN positions each. Past four
# chunks the WO merge stages every chunk's records in shared memory (merge_staged, ~2-4 us a
# layer more), which chunks this long repay in the attention (measured on the H200: never slower,
# 1,024 to 2,048 positions 4-8% faster a token; docs/MEGAKERNEL.md).
ATTN_WIDE = 16
ATTN_WIDE_MIN = 128


# Matrix formats of weights.bin. Q8_0 keeps a Q8_0 model's own weights (every matrix of the GGUF in
# Q8_0), laid out for the worker's 8-byte loads:
#   - a row of K columns is RB = q8_row_bytes(K) bytes: K int8 quants, then K / 32 f16 scales (scale b
#     for columns 32b..32b+31), zero padding to 16 bytes; weight = f32(scale) * f32(q), exact in f32;
#   - ffn_down, stored transposed (n_ff rows of n_embd = E), in blocks of 32 rows (the GGUF's blocks
#     run along n_ff): block b is the 32 rows' quants (E bytes each) and then E f16 scales, scale r
#     shared by column r of the 32 rows: 34 E bytes (q8_down_block_bytes).
# Either way the weights widen exactly to f32 and every dot product keeps BF16's order (dot_vec 8).
WEIGHT_FORMATS = ("bf16", "q8_0")
Q8_BLOCK = 32


def q8_row_bytes(cols: int) -> int:
    return _align(cols + cols // 16, 16)


def q8_down_block_bytes(n_embd: int) -> int:
    return 34 * n_embd


def row_bytes(dtype: str, cols: int) -> int:
    """Bytes of one row of `cols` columns of a matrix stored as `dtype` (not transposed)."""
    return q8_row_bytes(cols) if dtype == "q8_0" else cols * (2 if dtype == "bf16" else 4)


@dataclass(frozen=True)
class TensorSlot:
    """One tensor in weights.bin. shape is numpy order (rows, row_length)."""

    name: str
    offset: int
    dtype: str  # "bf16" or "q8_0" for matrices (WEIGHT_FORMATS), "f32" for vectors and tables
    shape: tuple[int, ...]
    transposed: bool = False  # stored as the transpose of the GGUF tensor (ffn_down)

    @property
    def n_bytes(self) -> int:
        if self.dtype == "q8_0" and self.transposed:
            return self.shape[0] // Q8_BLOCK * q8_down_block_bytes(self.shape[1])
        if len(self.shape) == 2:
            return self.shape[0] * row_bytes(self.dtype, self.shape[1])
        return math.prod(self.shape) * (2 if self.dtype == "bf16" else 4)


@dataclass
class Plan:
    """One token of one model on one target: what plan.json and tasks.bin hold."""

    model: dict  # ModelConfig as a dict
    target: Target
    consts: dict
    waves: list[dict]  # {"name", "layer", "opcode"}
    tasks: np.ndarray  # TASK_DTYPE, sorted by (wave, worker)
    tensors: dict[str, TensorSlot]
    fingerprint: dict = field(default_factory=dict)
    version: int = PLAN_VERSION

    @property
    def config(self) -> ModelConfig:
        names = {f.name for f in fields(ModelConfig)}
        data = {key: value for key, value in self.model.items() if key in names}
        data["layer_tensors"] = tuple(data.get("layer_tensors", ()))
        if isinstance(data.get("rope_scaling"), dict):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return ModelConfig(**data)


LLAMA_LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                       "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                       "ffn_down.weight")


def check_supported(config: ModelConfig) -> None:
    """The megakernel runs the plain Llama layout; name what else a model asks for."""
    extras = {
        "qk_norm": config.qk_norm, "post_norms": config.post_norms,
        "activation": config.activation != "silu", "sliding_window": config.sliding_window,
        "fused_qkv": getattr(config, "fused_qkv", False), "fused_gate_up": getattr(config, "fused_gate_up", False),
        "soft-capping": config.attn_logit_softcap or config.final_logit_softcap,
        f"rope scaling {config.rope_scaling.type}": config.rope_scaling.active,
    }
    found = [name for name, on in extras.items() if on]
    found += [f"tensor {name}" for name in config.layer_tensors if name not in LLAMA_LAYER_TENSORS]
    if found:
        raise UnsupportedError(f"{config.family} model uses {', '.join(found)}; the megakernel "
                               f"plans the Llama layout only (RMSNorm, separate Q/K/V, SiLU FFN, full attention)")


def check_format(config: ModelConfig, weights: str) -> None:
    """Q8_0 rows hold whole blocks of 32: every matrix's row length, and n_ff (ffn_down's blocks
    run along it), must be multiples of 32."""
    if weights not in WEIGHT_FORMATS:
        raise UnsupportedError(f"weight format {weights!r}, expected one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "q8_0":
        widths = {"n_embd": config.n_embd, "n_head * head_dim_v": config.n_head * config.head_dim_v,
                  "n_ff": config.n_ff}
        odd = [f"{name} = {value}" for name, value in widths.items() if value % Q8_BLOCK]
        if odd:
            raise UnsupportedError(f"{', '.join(odd)}: Q8_0 weights need multiples of {Q8_BLOCK}")


# ---- weights.bin layout --------------------------------------------------------------------------
def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def layout_weights(config: ModelConfig, ctx: int, weights: str = "bf16") -> tuple[dict[str, TensorSlot], int]:
    """Where every tensor lives in weights.bin, its matrices in format `weights` (WEIGHT_FORMATS).
    attn_q, attn_k, attn_v are adjacent (stacked)."""
    c = config
    m = weights
    specs = [("token_embd.weight", m, (c.vocab_size, c.n_embd), False)]
    if not c.tied_embeddings:
        specs.append(("output.weight", m, (c.vocab_size, c.n_embd), False))
    specs += [("output_norm.weight", "f32", (c.n_embd,), False),
              ("rope_cos", "f32", (ctx, c.rope_dim // 2), False),
              ("rope_sin", "f32", (ctx, c.rope_dim // 2), False)]
    for i in range(c.n_layers):
        specs += [(f"blk.{i}.attn_norm.weight", "f32", (c.n_embd,), False),
                  (f"blk.{i}.attn_q.weight", m, (c.n_q, c.n_embd), False),
                  (f"blk.{i}.attn_k.weight", m, (c.n_kv, c.n_embd), False),
                  (f"blk.{i}.attn_v.weight", m, (c.n_head_kv * c.head_dim_v, c.n_embd), False),
                  (f"blk.{i}.attn_output.weight", m, (c.n_embd, c.n_head * c.head_dim_v), False),
                  (f"blk.{i}.ffn_norm.weight", "f32", (c.n_embd,), False),
                  (f"blk.{i}.ffn_gate.weight", m, (c.n_ff, c.n_embd), False),
                  (f"blk.{i}.ffn_up.weight", m, (c.n_ff, c.n_embd), False),
                  (f"blk.{i}.ffn_down.weight", m, (c.n_ff, c.n_embd), True)]
    slots, offset = {}, 0
    for name, dtype, shape, transposed in specs:
        stacked = name.endswith(("attn_k.weight", "attn_v.weight"))
        offset = offset if stacked else _align(offset)
        slots[name] = TensorSlot(name, offset, dtype, shape, transposed)
        offset += slots[name].n_bytes
    return slots, _align(offset)


# ---- the activation arena ------------------------------------------------------------------------
def arena_layout(c: ModelConfig, attn_chunks: int, ffn_parts: int, lm_parts: int) -> dict[str, int]:
    """Every activation has its own place for the whole token (nothing is overwritten within a
    token), so a read can only ever see the one value its writer produced."""
    floats = ALIGN // 4
    x_stride = _align(c.n_embd, floats)
    layer, at = {}, 0
    n_qkv = c.n_q + c.n_kv + c.n_head_kv * c.head_dim_v
    for name, size in (("lay_qkv", n_qkv), ("lay_attn", attn_chunks * c.n_head * (c.head_dim_v + 2)),
                       ("lay_h", c.n_embd), ("lay_qkv_side", n_qkv), ("lay_h_side", c.n_embd),
                       ("lay_ffn", ffn_parts * c.n_embd)):
        layer[name] = at
        at = _align(at + size, floats)
    out = dict(layer, act_x=0, act_x_stride=x_stride, act_layer=(c.n_layers + 1) * x_stride, act_layer_size=at)
    at = out["act_layer"] + c.n_layers * at
    for name, size in (("act_xn", c.n_embd), ("act_logits", c.vocab_size), ("act_cand", 2 * lm_parts)):
        out[name] = at
        at = _align(at + size, floats)
    out["act_size"] = at
    return out


# ---- cutting rows --------------------------------------------------------------------------------
def split_rows(total: int, parts: int) -> list[tuple[int, int]]:
    """(start, count) for min(parts, total) pieces whose counts differ by at most one."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        count = base + (1 if i < extra else 0)
        out.append((start, count))
        start += count
    return out


def _task(op: Op, **fields) -> Task:
    return Task(opcode=int(op), **fields)


def _rows_wave(op: Op, total: int, workers: int, **fields) -> list[Task]:
    return [_task(op, row_start=s, row_count=n, slot=k, worker=k, **fields)
            for k, (s, n) in enumerate(split_rows(total, workers))]


def uneven(total: int, parts: int) -> float:
    """max / mean - 1 of `total` equal items dealt to `parts` workers as whole items."""
    return math.ceil(total / parts) / (total / parts) - 1.0


def _matrix_wave(op: Op, rows: int, cols: int, workers: int, split: bool, **fields) -> list[Task]:
    """Rows of a (rows, cols) matrix over the workers: whole rows, or split-K runs (module doc)."""
    per_row = cols // SPLIT_COLS
    fine = (split and uneven(rows, workers) > SPLIT_LIMIT and cols % SPLIT_COLS == 0
            and rows * per_row // workers >= per_row)  # every run holds a whole row's worth: 2 pieces a row at most
    if not fine:
        return _rows_wave(op, rows, workers, part_start=0, part_count=cols, **fields)
    tasks = []
    for k, (u0, n) in enumerate(split_rows(rows * per_row, workers)):
        u1 = u0 + n
        row, first = divmod(u0, per_row)
        if first:  # the rest of a row begun by worker k - 1: into the side vector
            tasks.append(_task(op, row_start=row, row_count=1, slot=k, worker=k, part_start=first * SPLIT_COLS,
                               part_count=cols - first * SPLIT_COLS, side=1, **fields))
            row += 1
        last, tail = divmod(u1, per_row)
        if last > row:
            tasks.append(_task(op, row_start=row, row_count=last - row, slot=k, worker=k, part_start=0,
                               part_count=cols, **fields))
        if tail:  # the first columns of a row that worker k + 1 finishes
            tasks.append(_task(op, row_start=last, row_count=1, slot=k, worker=k, part_start=0,
                               part_count=tail * SPLIT_COLS, **fields))
    return tasks


def ffn_sharing(n_ff: int, n_embd: int, workers: int, split: bool, weights: str = "bf16") -> int:
    """How many workers share each of the n_ff % workers leftover FFN rows (1: none is shared,
    whole rows as split_rows deals them). A sharer streams the row's gate and up rows again and
    1/s of its ffn_down column; the shares are dealt round robin. The smallest s that brings the
    wave within SPLIT_LIMIT while also lowering its busiest worker's bytes (the wave's time)."""
    base, extra = divmod(n_ff, workers)
    if not split or not base or not extra or uneven(n_ff, workers) <= SPLIT_LIMIT:
        return 1
    per = row_bytes(weights, n_embd) / n_embd  # bytes a weight takes
    unit = 3 * n_embd * per
    whole_max = (base + 1) * unit
    for s in range(2, n_embd // DOT_VEC + 1):
        sharer = 2 * n_embd * per + per * _ffn_pieces(n_embd, s)[0][1]
        most = base * unit + math.ceil(extra * s / workers) * sharer
        mean = base * unit + extra * s * sharer / workers
        if most >= whole_max:
            break  # more shares only add bytes to the busiest worker
        if most / mean - 1.0 <= SPLIT_LIMIT:
            return s
    return 1


def _ffn_pieces(n_embd: int, s: int) -> list[tuple[int, int]]:
    """ffn_down output rows of the s sharers of one row, in runs of DOT_VEC (the largest first)."""
    return [(start * DOT_VEC, count * DOT_VEC) for start, count in split_rows(n_embd // DOT_VEC, s)]


def _ffn_wave(c: ModelConfig, workers: int, share: int, **fields) -> list[Task]:
    e = c.n_embd
    if share == 1:
        return [_task(Op.FFN, row_start=s, row_count=n, slot=k, worker=k, part_start=0, part_count=e, **fields)
                for k, (s, n) in enumerate(split_rows(c.n_ff, workers))]
    base, extra = divmod(c.n_ff, workers)
    tasks = [_task(Op.FFN, row_start=k * base, row_count=base, slot=k, worker=k, part_start=0, part_count=e,
                   **fields) for k in range(workers)]
    pieces = _ffn_pieces(e, share)
    for j in range(extra * share):
        row, (start, count) = workers * base + j // share, pieces[j % share]
        tasks.append(_task(Op.FFN, row_start=row, row_count=1, slot=workers + j, worker=j % workers,
                           part_start=start, part_count=count, **fields))
    return tasks


def _layer_waves(c: ModelConfig, i: int, w: dict[str, TensorSlot], workers: int, consts: dict,
                 split: bool, share: int) -> list:
    def off(name: str) -> int:
        return w[f"blk.{i}.{name}.weight"].offset

    n_qkv = c.n_q + c.n_kv + c.n_head_kv * c.head_dim_v
    attn = [_task(Op.ATTN, layer=i, row_start=ch * consts["attn_chunk"], row_count=consts["attn_chunk"],
                  slot=ch, head=h, worker=(ch * c.n_head_kv + h) % workers)
            for ch in range(consts["attn_chunks"]) for h in range(c.n_head_kv)]
    ffn = _ffn_wave(c, workers, share, layer=i, weight0=off("ffn_gate"), weight1=off("ffn_up"),
                    weight2=off("ffn_down"), norm=off("ffn_norm"))
    return [
        (f"L{i}.qkv", i, _matrix_wave(Op.QKV, n_qkv, c.n_embd, workers, split, layer=i,
                                      weight0=off("attn_q"), norm=off("attn_norm"))),
        (f"L{i}.attn", i, attn),
        (f"L{i}.wo", i, _matrix_wave(Op.WO, c.n_embd, c.n_head * c.head_dim_v, workers, split, layer=i,
                                     weight0=off("attn_output"))),
        (f"L{i}.ffn", i, ffn),
        (f"L{i}.ffn_reduce", i, _rows_wave(Op.FFN_REDUCE, c.n_embd, workers, layer=i)),
    ]


def _consts(c: ModelConfig, target: Target, ctx: int, attn_chunk: int | None, attn_spread: int | None,
            w: dict[str, TensorSlot], weights_size: int, share: int, attn_wide: int | None = None,
            attn_wide_min: int | None = None) -> dict:
    if attn_chunk is None:
        # enough chunks to give every worker of the attention wave a task at full context
        attn_chunk = -(-ctx // max(1, target.workers // c.n_head_kv))
    attn_chunk = max(1, min(attn_chunk, ctx))
    attn_chunks = -(-ctx // attn_chunk)
    attn_spread = ATTN_SPREAD if attn_spread is None else attn_spread
    if attn_spread < 0:
        raise ValueError(f"attn_spread {attn_spread}: 0 (fixed chunks) or more")
    attn_wide = ATTN_WIDE if attn_wide is None else attn_wide
    attn_wide_min = ATTN_WIDE_MIN if attn_wide_min is None else attn_wide_min
    if attn_wide < 0 or attn_wide_min < 1:
        raise ValueError(f"attn_wide {attn_wide}, attn_wide_min {attn_wide_min}: expected attn_wide >= 0 "
                         "(0: none) and attn_wide_min >= 1")
    shared = (c.n_ff % target.workers) * share if share > 1 else 0  # slots of the shared leftover rows
    ffn_parts = min(target.workers, c.n_ff) + shared
    lm_parts = min(target.workers, c.vocab_size)
    consts = dict(
        n_layers=c.n_layers, n_embd=c.n_embd, n_head=c.n_head, n_head_kv=c.n_head_kv,
        head_dim=c.head_dim, head_dim_v=c.head_dim_v, rope_dim=c.rope_dim,
        rope_neox=int(c.rope_style == "neox"), n_ff=c.n_ff, vocab=c.vocab_size, ctx=ctx,
        attn_chunk=attn_chunk, attn_chunks=attn_chunks, attn_spread=attn_spread, attn_min=ATTN_MIN,
        attn_wide=attn_wide, attn_wide_min=attn_wide_min,
        ffn_parts=ffn_parts, lm_parts=lm_parts,
        dot_lanes=DOT_LANES, dot_vec=DOT_VEC, weights_q8=int(w["token_embd.weight"].dtype == "q8_0"),
        n_tasks=0, n_waves=0,
        rms_eps=float(np.float32(c.rms_eps)), attn_scale=float(np.float32(c.attention_scale())),
        embed_scale=float(np.float32(c.embedding_scale())),
        rope_cos=w["rope_cos"].offset, rope_sin=w["rope_sin"].offset, weights_size=weights_size,
    )
    consts.update(arena_layout(c, attn_chunks, ffn_parts, lm_parts))
    return {name: consts[name] for name in CONST_NAMES}


def make_plan(config: ModelConfig, target: Target, ctx: int | None = None,
              attn_chunk: int | None = None, split: bool = SPLIT_DEFAULT, attn_spread: int | None = None,
              attn_wide: int | None = None, attn_wide_min: int | None = None, weights: str = "bf16") -> Plan:
    """Plan one decode token of `config` on `target` for a K/V cache of `ctx` positions, its
    matrices in format `weights` (WEIGHT_FORMATS); `split` cuts weight waves finer than whole rows
    where those are more than SPLIT_LIMIT uneven; `attn_spread` (default ATTN_SPREAD; 0: fixed
    chunks) spreads a shorter context over that many attention chunks, `attn_wide` (default
    ATTN_WIDE; 0: none) a longer one over up to that many of at least `attn_wide_min`
    (ATTN_WIDE_MIN) positions (opcodes.attn_span)."""
    check_supported(config)
    check_format(config, weights)
    c = config
    ctx = ctx or min(c.ctx_train, DEFAULT_CTX)
    w, weights_size = layout_weights(c, ctx, weights)
    share = ffn_sharing(c.n_ff, c.n_embd, target.workers, split, weights)
    consts = _consts(c, target, ctx, attn_chunk, attn_spread, w, weights_size, share, attn_wide, attn_wide_min)
    head = w.get("output.weight", w["token_embd.weight"])
    waves = [("embed", 0, _rows_wave(Op.EMBED, c.n_embd, target.workers,
                                     weight0=w["token_embd.weight"].offset))]
    for i in range(c.n_layers):
        waves += _layer_waves(c, i, w, target.workers, consts, split, share)
    waves += [("final_norm", 0, _rows_wave(Op.FINAL_NORM, c.n_embd, target.workers,
                                           norm=w["output_norm.weight"].offset)),
              ("lm_head", 0, _rows_wave(Op.LM_HEAD, c.vocab_size, target.workers, weight0=head.offset))]
    tasks = _task_array(waves, target.workers)
    consts["n_tasks"], consts["n_waves"] = len(tasks), len(waves)
    wave_info = [{"name": name, "layer": layer, "opcode": Op(ts[0].opcode).name}
                 for name, layer, ts in waves]
    model = asdict(c)
    model["layer_tensors"] = list(model["layer_tensors"])
    return Plan(model, target, consts, wave_info, tasks, w, fingerprint(target))


def _task_array(waves: list, workers: int) -> np.ndarray:
    placed = [replace(t, wave=wave) for wave, (_, _, tasks) in enumerate(waves) for t in tasks]
    array = tasks_to_array(placed)
    order = np.lexsort((np.arange(len(array)), array["worker"], array["wave"]))
    return array[order]


def plan_is_split(plan: Plan) -> bool:
    """Whether `plan` was cut finer than whole rows (make_plan(split=True) where that changed
    something): a QKV/WO piece that is not a whole row, or FFN partial slots beyond one per worker."""
    t, k = plan.tasks, plan.consts
    matrix = (t["opcode"] == Op.QKV) | (t["opcode"] == Op.WO)
    return bool(np.any(t["side"][matrix] != 0) or np.any(t["part_start"][matrix] != 0)
                or k["ffn_parts"] > min(plan.target.workers, k["n_ff"]))


# ---- statistics ----------------------------------------------------------------------------------
def task_bytes(t, k: dict, pos: int | None = None) -> int:
    """Bytes a task streams from DRAM: its weight rows and its K/V rows at position `pos` (default:
    the last position of the context). Norm vectors and activations are left out: every task of
    a wave reads the same few KB, which come from L2 after the first."""
    op, n, e = Op(int(t["opcode"])), int(t["row_count"]), k["n_embd"]
    # a weight's bytes: 2 in BF16; in Q8_0 its quant and a 16th of its block's f16 scale (the
    # padding of a row is never read)
    per = 17 / 16 if k.get("weights_q8") else 2
    if op == Op.EMBED:
        return round(n * per)
    if op in (Op.QKV, Op.WO):
        return round(n * int(t["part_count"]) * per)
    if op == Op.ATTN:
        pos = k["ctx"] - 1 if pos is None else pos
        first, last = attn_chunk_positions(k, int(t["slot"]), pos)
        return (last - first) * (k["head_dim"] + k["head_dim_v"]) * 4
    if op == Op.FFN:
        return round((2 * n * e + n * int(t["part_count"])) * per)
    if op == Op.LM_HEAD:
        return round(n * e * per)
    return 0  # FFN_REDUCE and FINAL_NORM read only activations


def wave_bytes(plan: Plan, pos: int | None = None) -> np.ndarray:
    """(n_waves, workers) bytes each worker streams in each wave."""
    out = np.zeros((plan.consts["n_waves"], plan.target.workers), dtype=np.int64)
    for t in plan.tasks:
        out[int(t["wave"]), int(t["worker"])] += task_bytes(t, plan.consts, pos)
    return out


def imbalance(row: np.ndarray) -> float:
    """max / mean - 1 over all workers of a wave (idle workers count as 0 bytes)."""
    mean = row.mean()
    return float(row.max() / mean - 1.0) if mean else 0.0


def plan_stats(plan: Plan, pos: int | None = None) -> dict:
    per_wave = wave_bytes(plan, pos)
    waves = []
    for w, info in enumerate(plan.waves):
        row = per_wave[w]
        in_wave = plan.tasks["wave"] == w
        waves.append(dict(info, wave=w, tasks=int(in_wave.sum()),
                          busy_workers=len(np.unique(plan.tasks["worker"][in_wave])),
                          max_bytes=int(row.max()), mean_bytes=float(row.mean()), imbalance=imbalance(row)))
    weight_waves = [wv for wv in waves if wv["opcode"] in ("QKV", "WO", "FFN", "LM_HEAD")]
    return {"tasks": len(plan.tasks), "waves": len(plan.waves), "workers": plan.target.workers,
            "bytes_per_token": int(per_wave.sum()),
            "max_weight_wave_imbalance": max(wv["imbalance"] for wv in weight_waves),
            "per_wave": waves}
