"""The planner: one decode token cut into tasks, each on a fixed worker, in waves between barriers.

Llama layout, waves per token: embed, then per layer qkv, attn, wo, ffn, ffn_reduce, then
final_norm and lm_head (1 + 5 * n_layers + 2). Attention is flash-decoding: each (K/V head,
chunk) task writes a partial (max, sum, weighted values) and the WO tasks merge the active
chunks, so no barrier sits between scores and values. Weight waves split rows evenly over the
workers; every row of a matrix is the same number of bytes, so equal rows are equal bytes.

The plan is made for a maximum context `ctx` (the K/V cache size) and is valid at every position
p < ctx: chunk c covers positions [c*C, min((c+1)*C, p+1)) and runs only when c*C <= p.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from ..errors import UnsupportedError
from ..family import ModelConfig
from ..rope_scaling import RopeScaling
from .opcodes import CONST_NAMES, PLAN_VERSION, Op, Task, tasks_to_array
from .target import Target, fingerprint

ALIGN = 256  # byte alignment of every tensor in weights.bin and of every arena region (in floats / 4)
DOT_LANES = 32
DOT_VEC = 8
DEFAULT_CTX = 4096


@dataclass(frozen=True)
class TensorSlot:
    """One tensor in weights.bin. shape is numpy order (rows, row_length)."""

    name: str
    offset: int
    dtype: str  # "bf16" for matrices, "f32" for vectors and tables
    shape: tuple[int, ...]
    transposed: bool = False  # stored as the transpose of the GGUF tensor (ffn_down)

    @property
    def n_bytes(self) -> int:
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


# ---- weights.bin layout --------------------------------------------------------------------------
def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def layout_weights(config: ModelConfig, ctx: int) -> tuple[dict[str, TensorSlot], int]:
    """Where every tensor lives in weights.bin. attn_q, attn_k, attn_v are adjacent (stacked)."""
    c = config
    specs = [("token_embd.weight", "bf16", (c.vocab_size, c.n_embd), False)]
    if not c.tied_embeddings:
        specs.append(("output.weight", "bf16", (c.vocab_size, c.n_embd), False))
    specs += [("output_norm.weight", "f32", (c.n_embd,), False),
              ("rope_cos", "f32", (ctx, c.rope_dim // 2), False),
              ("rope_sin", "f32", (ctx, c.rope_dim // 2), False)]
    for i in range(c.n_layers):
        specs += [(f"blk.{i}.attn_norm.weight", "f32", (c.n_embd,), False),
                  (f"blk.{i}.attn_q.weight", "bf16", (c.n_q, c.n_embd), False),
                  (f"blk.{i}.attn_k.weight", "bf16", (c.n_kv, c.n_embd), False),
                  (f"blk.{i}.attn_v.weight", "bf16", (c.n_head_kv * c.head_dim_v, c.n_embd), False),
                  (f"blk.{i}.attn_output.weight", "bf16", (c.n_embd, c.n_head * c.head_dim_v), False),
                  (f"blk.{i}.ffn_norm.weight", "f32", (c.n_embd,), False),
                  (f"blk.{i}.ffn_gate.weight", "bf16", (c.n_ff, c.n_embd), False),
                  (f"blk.{i}.ffn_up.weight", "bf16", (c.n_ff, c.n_embd), False),
                  (f"blk.{i}.ffn_down.weight", "bf16", (c.n_ff, c.n_embd), True)]
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
    for name, size in (("lay_qkv", c.n_q + c.n_kv + c.n_head_kv * c.head_dim_v),
                       ("lay_attn", attn_chunks * c.n_head * (c.head_dim_v + 2)),
                       ("lay_h", c.n_embd), ("lay_ffn", ffn_parts * c.n_embd)):
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
    return [_task(op, row_start=s, row_count=n, slot=k, **fields)
            for k, (s, n) in enumerate(split_rows(total, workers))]


def _layer_waves(c: ModelConfig, i: int, w: dict[str, TensorSlot], workers: int, consts: dict) -> list:
    def off(name: str) -> int:
        return w[f"blk.{i}.{name}.weight"].offset

    n_qkv = c.n_q + c.n_kv + c.n_head_kv * c.head_dim_v
    attn = [_task(Op.ATTN, layer=i, row_start=ch * consts["attn_chunk"], row_count=consts["attn_chunk"],
                  slot=ch, head=h)
            for ch in range(consts["attn_chunks"]) for h in range(c.n_head_kv)]
    ffn_rows = split_rows(c.n_ff, workers)
    ffn = [_task(Op.FFN, layer=i, row_start=s, row_count=n, slot=k, weight0=off("ffn_gate"),
                 weight1=off("ffn_up"), weight2=off("ffn_down"), norm=off("ffn_norm"))
           for k, (s, n) in enumerate(ffn_rows)]
    return [
        (f"L{i}.qkv", i, _rows_wave(Op.QKV, n_qkv, workers, layer=i, weight0=off("attn_q"),
                                    norm=off("attn_norm"))),
        (f"L{i}.attn", i, attn),
        (f"L{i}.wo", i, _rows_wave(Op.WO, c.n_embd, workers, layer=i, weight0=off("attn_output"))),
        (f"L{i}.ffn", i, ffn),
        (f"L{i}.ffn_reduce", i, _rows_wave(Op.FFN_REDUCE, c.n_embd, workers, layer=i)),
    ]


def _consts(c: ModelConfig, target: Target, ctx: int, attn_chunk: int | None,
            w: dict[str, TensorSlot], weights_size: int) -> dict:
    if attn_chunk is None:
        # enough chunks to give every worker of the attention wave a task at full context
        attn_chunk = -(-ctx // max(1, target.workers // c.n_head_kv))
    attn_chunk = max(1, min(attn_chunk, ctx))
    attn_chunks = -(-ctx // attn_chunk)
    ffn_parts = min(target.workers, c.n_ff)
    lm_parts = min(target.workers, c.vocab_size)
    consts = dict(
        n_layers=c.n_layers, n_embd=c.n_embd, n_head=c.n_head, n_head_kv=c.n_head_kv,
        head_dim=c.head_dim, head_dim_v=c.head_dim_v, rope_dim=c.rope_dim,
        rope_neox=int(c.rope_style == "neox"), n_ff=c.n_ff, vocab=c.vocab_size, ctx=ctx,
        attn_chunk=attn_chunk, attn_chunks=attn_chunks, ffn_parts=ffn_parts, lm_parts=lm_parts,
        dot_lanes=DOT_LANES, dot_vec=DOT_VEC, n_tasks=0, n_waves=0,
        rms_eps=float(np.float32(c.rms_eps)), attn_scale=float(np.float32(c.attention_scale())),
        embed_scale=float(np.float32(c.embedding_scale())),
        rope_cos=w["rope_cos"].offset, rope_sin=w["rope_sin"].offset, weights_size=weights_size,
    )
    consts.update(arena_layout(c, attn_chunks, ffn_parts, lm_parts))
    return {name: consts[name] for name in CONST_NAMES}


def make_plan(config: ModelConfig, target: Target, ctx: int | None = None,
              attn_chunk: int | None = None) -> Plan:
    """Plan one decode token of `config` on `target` for a K/V cache of `ctx` positions."""
    check_supported(config)
    c = config
    ctx = ctx or min(c.ctx_train, DEFAULT_CTX)
    w, weights_size = layout_weights(c, ctx)
    consts = _consts(c, target, ctx, attn_chunk, w, weights_size)
    head = w.get("output.weight", w["token_embd.weight"])
    waves = [("embed", 0, _rows_wave(Op.EMBED, c.n_embd, target.workers,
                                     weight0=w["token_embd.weight"].offset))]
    for i in range(c.n_layers):
        waves += _layer_waves(c, i, w, target.workers, consts)
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
    placed = [replace(t, wave=wave, worker=k % workers)
              for wave, (_, _, tasks) in enumerate(waves) for k, t in enumerate(tasks)]
    array = tasks_to_array(placed)
    order = np.lexsort((np.arange(len(array)), array["worker"], array["wave"]))
    return array[order]


# ---- statistics ----------------------------------------------------------------------------------
def task_bytes(t, k: dict, pos: int | None = None) -> int:
    """Bytes a task streams from DRAM: its weight rows and its K/V rows at position `pos` (default:
    the last position of the context). Norm vectors and activations are left out: every task of
    a wave reads the same few KB, which come from L2 after the first."""
    op, n, e = Op(int(t["opcode"])), int(t["row_count"]), k["n_embd"]
    if op == Op.EMBED:
        return n * 2
    if op == Op.QKV:
        return n * e * 2
    if op == Op.ATTN:
        pos = k["ctx"] - 1 if pos is None else pos
        first = int(t["row_start"])
        count = max(0, min(first + n, pos + 1) - first)
        return count * (k["head_dim"] + k["head_dim_v"]) * 4
    if op == Op.WO:
        return n * k["n_head"] * k["head_dim_v"] * 2
    if op == Op.FFN:
        return 3 * n * e * 2
    if op == Op.LM_HEAD:
        return n * e * 2
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
