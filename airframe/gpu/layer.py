"""The dispatches of one layer and of the model's ends, built once at load.

A forward is a prefill chunk (n_tokens positions of one slot) or decode (n_tokens tokens, each the next
position of its own slot: one, or a batch of conversations); the ops of one phase only run in it.
Each Op holds its bind group and parameter buffer; `dispatch(n_tokens, n_splits)` only picks the
program (gemv.wgsl for up to pipes.gemv_tokens tokens, gemm.wgsl for a longer chunk, gemm_rows.wgsl on CPU
adapters) and the workgroup counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import UnsupportedError
from . import pipelines as pl
from .pack import PackedTensor


@dataclass
class Op:
    label: str
    shader: str                      # "matmul": gemv, gemm or gemm_rows, by the token count
    quant: object
    bind_group: object
    grid: Callable[[int, int], tuple[int, int, int]] | None = None
    rows: int = 0
    cols: int = 0
    output: tuple | None = None      # (buffer, floats per token) for SHIMMY_DEBUG_RAW
    shape: dict | None = None        # the program's model-shape placeholders (pl.attention_shapes)
    phase: str | None = None         # "decode" or "prefill": runs only in that phase
    # runs only for these (n_tokens, n_splits): split_sum where gemm.wgsl leaves partials
    when: Callable[[int, int], bool] | None = None
    gated: bool = False              # MODE_GATED: rows are gate rows, each with an up row
    k_splits: int = 1                # gemm.wgsl's workgroups along K for a chunk (pipes.gemm_splits)
    # gemm.wgsl's bind group where it differs: the normalized input (chunk_norm) and/or the partials
    gemm_group: object = None
    partials: tuple | None = None    # split_sum: (partials buffer, splits), for a norm that adds them itself
    unit: str | None = None          # gemv.wgsl's unit file where it is not the quant type's own (MIXED_UNITS)
    mode: int = 0                    # gemv.wgsl's MODE: the mode its bind group's params carry
    x_stored: bool = False           # gemv.wgsl reads x rounded by the gemv before (MODE_ROUND_OUT)

    def program(self, pipes: pl.Pipelines, n_tokens: int) -> str:
        """The shader this op runs for n_tokens."""
        if self.shader != "matmul":
            return self.shader
        if pipes.matmul == "rows" or self.cols % pl.GEMM_K or (n_tokens > pipes.gemv_tokens and pipes.half != "f16"):
            return "gemm_rows"  # gemm.wgsl computes in f16: without shader-f16 chunks take gemm_rows.wgsl
        return "gemv" if n_tokens <= pipes.gemv_tokens else "gemm"  # gemv: decode tokens or a short chunk

    def dispatch(self, pipes: pl.Pipelines, n_tokens: int, n_splits: int) -> pl.Dispatch:
        shape, group = self.shape, self.bind_group
        shader = self.program(pipes, n_tokens)
        if self.shader != "matmul":
            grid = self.grid(n_tokens, n_splits)
        elif shader == "gemm_rows":
            tokens = pl.rows_tokens(n_tokens)
            shape = {"ROWS_TOKENS": tokens}
            grid = (pl.ceil_div(self.rows, pl.ROWS_WG), pl.ceil_div(n_tokens, tokens), 1)
        elif shader == "gemv":
            rows_wg, shape = pipes.decode_matmul(self.rows, self.cols, self.quant, n_tokens, self.unit, self.mode,
                                                 self.x_stored)
            grid = (pl.ceil_div(self.rows, rows_wg), pl.ceil_div(n_tokens, shape["GEMV_TOKENS"]), 1)
        else:
            grid = (pipes.gemm_groups(self.rows, self.gated), pl.ceil_div(n_tokens, pl.GEMM_TILE_TOKENS), self.k_splits)
            group = self.gemm_group or group
        out = None if self.output is None else (self.output[0], self.output[1] * n_tokens)
        return pl.Dispatch(self.label, pipes.pipeline(shader, self.quant, shape), group, grid, out)


@dataclass
class LayerOps:
    pipes: pl.Pipelines
    ops: list[Op]
    # the split_sum of this layer's ffn_down, left to the next layer's attn_norm (chunk_norm)
    carry: Op | None = None
    _cache: dict = field(default_factory=dict)

    def dispatches(self, n_tokens: int, n_splits: int, decode: bool | None = None) -> list[pl.Dispatch]:
        """The layer's dispatches for n_tokens, decode by default for one token only."""
        phase = "decode" if (n_tokens == 1 if decode is None else decode) else "prefill"
        key = (n_tokens, n_splits, phase)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = [op.dispatch(self.pipes, n_tokens, n_splits) for op in self.ops
                                if op.phase in (None, phase) and (op.when is None or op.when(n_tokens, n_splits))]
        return list(self._cache[key])


def _matmul(be, label: str, layer, weights: list[PackedTensor], x, x_stride: int, y, y_stride: int,
            y_off: int = 0, mode: int = 0, norm: PackedTensor | None = None, qkv_group: int = 0,
            unit: str | None = None, xq_off: int = 0, x_stored: bool = False) -> list[Op]:
    """y = W x with up to three row segments (or gate/up with MODE_GATED); for a matrix that chunks
    split along K, also the split_sum.wgsl op that adds the partials (be.group_partials(qkv_group))
    into y. With MODE_NORM, gemm.wgsl reads x normalized by chunk_norm (scratch tmp) instead. With
    `unit` (a decode-only gemv unit, MIXED_UNITS) only the gemv.wgsl op. xq_off: where in y the gemv
    stores its output rounded (MODE_ROUND_OUT), or, with x_stored, where in x it finds its input so."""
    c = be.config
    first = weights[0]
    gated = mode & pl.MODE_GATED
    offsets = [w.offset for w in weights] + [0] * (3 - len(weights))
    # the gemv units that bind W as vec4 (gemv/quads.wgsl) need 16-byte offsets: pack.py aligns every tensor to 64 words
    assert all(o % 4 == 0 for o in offsets), f"{label}: weight word offsets {offsets} not 16-byte aligned"
    starts = [sum(w.rows for w in weights[:i]) for i in range(1, len(weights))] if not gated else []
    starts += [pl.NO_SEGMENT] * (2 - len(starts))
    rows = first.rows if gated else sum(w.rows for w in weights)
    k, s = be.pipes, be.scratch

    def bind(x_in, out, out_mode: int, out_stride: int, out_off: int):
        params = pl.pack_params(
            "gemv", rows=rows, cols=first.cols, row_words=first.row_words, mode=out_mode,
            w0=offsets[0], w1=offsets[1], w2=offsets[2], seg1=starts[0], seg2=starts[1],
            norm_w=norm.offset if norm else 0, eps=c.rms_eps, x_stride=x_stride, y_stride=out_stride, y_off=out_off,
            row_words2=weights[-1].row_words, xq_off=xq_off)
        return k.bind("gemv", [layer, x_in, out, k.uniform(params, label), s.step])

    op = Op(label, "matmul", first.quant, bind(x, y, mode, y_stride, y_off), rows=rows, cols=first.cols,
            output=(y, y_stride), gated=bool(gated), unit=unit, mode=mode, x_stored=x_stored)
    mode &= ~pl.MODE_ROUND_OUT  # gemv.wgsl's only
    if unit:
        return [op]
    splits = k.gemm_splits(rows, first.cols, bool(gated))
    gemm_x, gemm_mode = (s.tmp, mode & ~pl.MODE_NORM) if mode & pl.MODE_NORM else (x, mode)
    if splits == 1:
        if gemm_x is not x:
            op.gemm_group = bind(gemm_x, y, gemm_mode, y_stride, y_off)
        return [op]
    assert splits * rows <= s.split_width, f"{label}: {splits} splits of {rows} rows outgrow the partials buffer"
    part = be.group_partials(qkv_group)
    op.k_splits, op.gemm_group = splits, bind(gemm_x, part, gemm_mode & ~pl.MODE_ACCUMULATE, rows, 0)
    params = pl.pack_params("split_sum", rows=rows, splits=splits, y_stride=y_stride, y_off=y_off,
                            accumulate=int(bool(mode & pl.MODE_ACCUMULATE)))
    group = k.bind("split_sum", [part, y, k.uniform(params, f"{label}.split_sum"), s.step])
    return [op, Op(f"{label}.split_sum", "split_sum", None, group, grid=lambda t, n: (pl.ceil_div(rows, 256), t, 1),
                   output=(y, y_stride), when=lambda t, n: t > k.gemv_tokens, partials=(part, splits))]


def _rmsnorm(be, label: str, layer, norm: PackedTensor, x, y, n: int, add: bool,
             partials: tuple | None = None) -> Op:
    part, splits = partials or (be.scratch.split, 0)
    params = pl.pack_params("rmsnorm", n=n, norm_w=norm.offset, eps=be.config.rms_eps, add=int(add),
                           x_stride=n, y_stride=n, splits=splits)
    k = be.pipes
    group = k.bind("rmsnorm", [layer, x, y, part, k.uniform(params, label), be.scratch.step])
    return Op(label, "rmsnorm", None, group, grid=lambda t, s: (t, 1, 1), output=(y, n))


def chunk_norm(be, label: str, layer, norm: PackedTensor, matmul: Op, sums: Op | None = None) -> Op:
    """RMSNorm of each token of x into scratch tmp, where `matmul` runs as gemm.wgsl (which reads its
    input normalized): once per token rather than once per workgroup of the matmul. With `sums`, the
    split_sum op of the matmul before it (adding to x), the norm adds those partials to x itself and
    runs wherever that op would: one dispatch and one pass over x fewer."""
    op = _rmsnorm(be, label, layer, norm, be.scratch.x, be.scratch.tmp, be.config.n_embd, add=False,
                  partials=sums.partials if sums else None)
    op.when = sums.when if sums else (lambda t, n: matmul.program(be.pipes, t) == "gemm")
    return op


def _split_sum(ops: list[Op]) -> tuple[list[Op], Op | None]:
    """A matmul's ops (_matmul) without its split_sum op, and that op (None without a K-split)."""
    return ops[:1], (ops[1] if len(ops) > 1 else None)


# gemv units for Q, K of one quant type and V of another in one dispatch: (Q/K type, V type) -> unit
MIXED_UNITS = {("q4_k", "q6_k"): "q4_k_q6_k", ("q5_k", "q6_k"): "q5_k_q6_k"}


def _mixed_unit(groups: list[list[PackedTensor]]) -> str | None:
    """The gemv unit that takes a layer's QKV groups in one dispatch (Q4_K_M's Q4_K Q and K with a
    Q6_K V, Q5_K_M's Q5_K with Q6_K), or None."""
    if len(groups) != 2 or len(groups[0]) != 2 or len(groups[1]) != 1:
        return None
    return MIXED_UNITS.get((groups[0][0].quant.shader, groups[1][0].quant.shader))


def _qkv_groups(tensors: list[PackedTensor]) -> list[list[PackedTensor]]:
    """Consecutive tensors of one quant type go into one dispatch."""
    groups: list[list[PackedTensor]] = []
    for t in tensors:
        if groups and groups[-1][0].qtype == t.qtype and groups[-1][0].cols == t.cols:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


def _row_halves(t: PackedTensor, rows: int) -> tuple[PackedTensor, PackedTensor]:
    """Rows [0, rows) and [rows, 2 rows) of a packed matrix as two tensors (Phi-3's gate | up)."""
    return (replace(t, name=f"{t.name}[gate]", rows=rows),
            replace(t, name=f"{t.name}[up]", rows=rows, offset=t.offset + rows * t.row_words))


def _down_x_stored(pipes: pl.Pipelines, gate: PackedTensor, down: PackedTensor) -> bool:
    """Whether ffn_down's gemv reads its x as the gate/up gemv rounded and stored it (MODE_ROUND_OUT)
    rather than rounding it itself, once per workgroup: where its unit rounds x to 8 bits, the gate/up
    workgroups hold whole blocks of 16 rows, and the two matrices take gemv.wgsl for the same token
    counts (tiled pipelines, both widths a multiple of GEMM_K)."""
    rows_wg = pipes.gemv_rows(gate.rows, gate.cols, gate.quant.shader)
    return (pipes.matmul == "tiled" and bool(pl.shader_constant(f"gemv/{down.quant.shader}.wgsl", "INT8_X"))
            and rows_wg % 16 == 0 and gate.rows % 16 == 0 and gate.cols % pl.GEMM_K == 0 and down.cols % pl.GEMM_K == 0)


def build_layer(be, i: int, carried: Op | None = None) -> LayerOps:
    """Layer i's ops; `carried`: the previous layer's LayerOps.carry, whose sums its attn_norm does."""
    c = be.config
    s = be.scratch
    pack = be.layers[i]
    buf = pack.buffer
    k = be.pipes
    w = {name.split(".", 2)[2].removesuffix(".weight"): t for name, t in pack.tensors.items()}
    n_qkv = c.n_q + 2 * c.n_kv
    ops = []
    col = 0
    qkv = [w["attn_qkv"]] if c.fused_qkv else [w["attn_q"], w["attn_k"], w["attn_v"]]
    groups = []  # (first column, split_sum op or None) per QKV matmul
    # Q4_K_M's Q/K and V: each group's K-split partials in a buffer of its own, summed after both
    # (by rope.wgsl in a chunk), so that the GPU may run the two matmuls at once (no barrier between)
    qkv_groups = _qkv_groups(qkv)
    for g, group in enumerate(qkv_groups):
        matmul, sum_op = _split_sum(_matmul(be, f"blk.{i}.qkv@{col}", buf, group, s.x, c.n_embd, s.qkv, n_qkv,
                                            col, pl.MODE_NORM, w["attn_norm"], qkv_group=g))
        ops += matmul
        groups.append((col, sum_op))
        col += sum(t.rows for t in group)
    unit = _mixed_unit(qkv_groups)
    if unit:  # decode tokens take the groups in one gemv; chunks (gemm.wgsl) one matrix type at a time
        mixed = _matmul(be, f"blk.{i}.qkv", buf, qkv, s.x, c.n_embd, s.qkv, n_qkv, 0, pl.MODE_NORM, w["attn_norm"],
                        unit=unit)[0]
        for op in ops:
            op.when = lambda t, n, op=op: op.program(k, t) != "gemv"
        mixed.when = lambda t, n: mixed.program(k, t) == "gemv"
        ops.insert(0, mixed)
    sums = [op for _, op in groups if op]
    for op in sums:  # a chunk's rope.wgsl sums the partials; a batch of decode tokens keeps the op
        op.phase = "decode"
    ops = [chunk_norm(be, f"blk.{i}.attn_norm", buf, w["attn_norm"], ops[0], carried)] + ops + sums

    def rope(parts: list[tuple[int, int]]) -> bytes:
        return pl.pack_params(
            "rope", n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim, rope_dim=c.rope_dim,
            neox=int(c.rope_style == "neox"), qk_norm=int(c.qk_norm),
            q_norm_w=w["attn_q_norm"].offset if c.qk_norm else 0, k_norm_w=w["attn_k_norm"].offset if c.qk_norm else 0,
            eps=c.rms_eps, qkv_stride=n_qkv, n_ctx=be.n_ctx, table=be.table_offsets[c.layer_rope_base(i)],
            qkv_bias=int(c.qkv_bias), q_bias=w["attn_q.bias"].offset if c.qkv_bias else 0,
            k_bias=w["attn_k.bias"].offset if c.qkv_bias else 0, v_bias=w["attn_v.bias"].offset if c.qkv_bias else 0,
            **pl.rope_groups(n_qkv, parts))

    rope_params = k.uniform(rope([]))
    # each group's partials buffer for rope.wgsl (scratch split where it has none: bound, not read)
    parts = [op.partials[0] if op else s.split for _, op in groups] + [s.split] * (3 - len(groups))

    def rope_op(params, when=None) -> Op:
        group = k.bind("rope", [buf, be.rope_table, s.qkv, be.kv[i], params, s.step, *parts])
        # a decode token's attention does this work itself
        return Op(f"blk.{i}.rope", "rope", None, group, grid=lambda t, n: (c.n_head + c.n_head_kv, t, 1),
                  output=(s.qkv, n_qkv), phase="prefill", when=when)

    if not sums:
        ops.append(rope_op(rope_params))
    else:  # where the matmuls are split (sums[0].when), rope.wgsl reads their partials
        split = sums[0].when
        ops.append(rope_op(rope_params, lambda t, n: not split(t, n)))
        ops.append(rope_op(k.uniform(rope([(start, op.partials[1] if op else 0) for start, op in groups])), split))

    window = c.sliding_window if c.is_local_layer(i) else 0
    attn = k.uniform(pl.pack_params("attention_decode", n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                                    n_ctx=be.n_ctx, window=window, scale=c.attention_scale(), qkv_stride=n_qkv,
                                    softcap=c.attn_logit_softcap))
    decode_shape, prefill_shape = be.attention_shapes
    # decode tokens: QK-norm, RoPE and the K/V write inside their attention, split along the cache;
    # each token's row (s.rows) says where its slot's cache lies in the layer's K/V buffer
    group = k.bind("attention_decode", [s.qkv, buf, be.rope_table, be.kv_group[i], s.part, s.attn, attn, rope_params,
                                        s.rows, s.arrived])
    ops.append(Op(f"blk.{i}.attention", "attention_decode", None, group, grid=lambda t, n: (n, c.n_head_kv, t),
                  output=(s.attn, c.n_q), shape=decode_shape, phase="decode"))
    group = k.bind("attention_prefill", [s.qkv, be.kv[i], s.attn, attn, s.step])
    rows = c.n_head // c.n_head_kv  # query rows per token and K/V head
    ops.append(Op(f"blk.{i}.attention", "attention_prefill", None, group,
                  grid=lambda t, n: (pl.ceil_div(t * rows, 64), c.n_head_kv, 1), shape=prefill_shape,
                  output=(s.attn, c.n_q), phase="prefill"))

    wo_sum = None  # the output projection's split_sum, left to ffn_norm
    if c.post_norms:
        ops += _matmul(be, f"blk.{i}.attn_output", buf, [w["attn_output"]], s.attn, c.n_q, s.tmp, c.n_embd)
        ops.append(_rmsnorm(be, f"blk.{i}.post_attention_norm", buf, w["post_attention_norm"], s.tmp, s.x,
                            c.n_embd, add=True))
    else:
        wo, wo_sum = _split_sum(_matmul(be, f"blk.{i}.attn_output", buf, [w["attn_output"]], s.attn, c.n_q,
                                        s.x, c.n_embd, mode=pl.MODE_ACCUMULATE))
        ops += wo

    gate, up = _row_halves(w["ffn_up"], c.n_ff) if c.fused_gate_up else (w["ffn_gate"], w["ffn_up"])
    if gate.qtype != up.qtype:
        raise UnsupportedError(f"{be.gf.path}: blk.{i}.ffn_gate is {gate.qtype.name} but ffn_up is "
                               f"{up.qtype.name}; the fused gate/up kernel expects one type")
    act = pl.MODE_GELU if c.activation == "gelu_tanh" else 0
    stored = _down_x_stored(k, gate, w["ffn_down"])
    round_out = pl.MODE_ROUND_OUT if stored else 0
    gate_up = _matmul(be, f"blk.{i}.ffn_gate_up", buf, [gate, up], s.x, c.n_embd, s.ffn, c.n_ff,
                      mode=pl.MODE_NORM | pl.MODE_GATED | act | round_out, norm=w["ffn_norm"], xq_off=s.ffn_stored)
    ops += [chunk_norm(be, f"blk.{i}.ffn_norm", buf, w["ffn_norm"], gate_up[0], wo_sum)] + gate_up
    down_x = dict(xq_off=s.ffn_stored, x_stored=stored)
    if c.post_norms:
        ops += _matmul(be, f"blk.{i}.ffn_down", buf, [w["ffn_down"]], s.ffn, c.n_ff, s.tmp, c.n_embd, **down_x)
        ops.append(_rmsnorm(be, f"blk.{i}.post_ffw_norm", buf, w["post_ffw_norm"], s.tmp, s.x, c.n_embd, add=True))
        return LayerOps(k, ops)
    down = _matmul(be, f"blk.{i}.ffn_down", buf, [w["ffn_down"]], s.ffn, c.n_ff, s.x, c.n_embd,
                   mode=pl.MODE_ACCUMULATE, **down_x)
    if i == c.n_layers - 1:  # the final norm runs on decode tokens too: the last layer sums its own
        return LayerOps(k, ops + down)
    down, down_sum = _split_sum(down)
    return LayerOps(k, ops + down, carry=down_sum)


@dataclass
class GlobalOps:
    """Embedding lookup (one dispatch per row chunk), final norm, LM head (one dispatch per chunk)."""

    pipes: pl.Pipelines
    embed_ops: list[Op]
    norm_op: Op
    head_ops: list[Op]

    def embed(self, n_tokens: int) -> list[pl.Dispatch]:
        return [op.dispatch(self.pipes, n_tokens, 1) for op in self.embed_ops]

    def final_norm(self, n_tokens: int) -> list[pl.Dispatch]:
        return [self.norm_op.dispatch(self.pipes, n_tokens, 1)]

    def lm_head(self, n_tokens: int) -> list[pl.Dispatch]:
        return [op.dispatch(self.pipes, n_tokens, 1) for op in self.head_ops]


def build_globals(be) -> GlobalOps:
    c = be.config
    s = be.scratch
    k = be.pipes
    embed_ops = []
    e = be.token_embd
    for j, chunk in enumerate(e.chunks):
        params = pl.pack_params("embedding", first_row=chunk.first_row, n_rows=chunk.n_rows, cols=e.cols,
                               row_words=e.row_words, scale=c.embedding_scale())
        group = k.bind("embedding", [(chunk.buffer, chunk.offset, chunk.size), s.ids, s.x, k.uniform(params), s.step])
        embed_ops.append(Op(f"token_embd#{j}", "embedding", e.quant, group, grid=lambda t, n: (t, 1, 1),
                            output=(s.x, c.n_embd)))
    norm_op = _rmsnorm(be, "output_norm", be.globals.buffer, be.globals["output_norm.weight"], s.x, s.tmp,
                       c.n_embd, add=False)
    head_ops = []
    h = be.output
    head_mode = pl.MODE_X_STEP  # the LM head reads the step's last position
    for j, chunk in enumerate(h.chunks):
        params = pl.pack_params(
            "gemv", rows=chunk.n_rows, cols=h.cols, row_words=h.row_words, mode=head_mode, w0=0, w1=0, w2=0,
            seg1=pl.NO_SEGMENT, seg2=pl.NO_SEGMENT, norm_w=0, eps=c.rms_eps, x_stride=c.n_embd,
            y_stride=c.vocab_size, y_off=chunk.first_row, row_words2=h.row_words, xq_off=0)
        group = k.bind("gemv", [(chunk.buffer, chunk.offset, chunk.size), s.tmp, s.logits, k.uniform(params), s.head_step])
        head_ops.append(Op(f"lm_head#{j}", "matmul", h.quant, group, rows=chunk.n_rows, cols=h.cols,
                           output=(s.logits, c.vocab_size), mode=head_mode))
    return GlobalOps(k, embed_ops, norm_op, head_ops)
