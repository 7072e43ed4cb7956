"""The numpy VM: executes a plan task by task, wave by wave, exactly as the CUDA worker must.

It is the reference the CUDA worker is diffed against, so every floating-point operation has a
fixed order (docs/MEGAKERNEL.md, "Reduction orders"):
  - dot(w, x) over K elements (`lane_sum`): lane l of a warp owns the 8-element vectors j with
    j % 32 == l; its one accumulator starts at +0 and adds w*x element by element in increasing
    order (multiply, round, add, round: no FMA); the 32 lanes fold in halves (l + 16, ..., + 1).
  - attention: the exp-sum over positions is a lane sum with 8 = 1 (lane p % 32); the weighted
    values and the FFN down projection run in `groups` strided groups (item i in group
    i % groups, each group from +0 in increasing i), then add the groups in order;
    groups = threads_per_worker / head_dim_v, and threads / (n_embd / 8) for the FFN.
  - sums over chunks (the WO merge) run sequentially from +0 in increasing order; which positions a
    chunk holds at a position is opcodes.attn_span's rule (the plan's attn_spread).
  - the FFN reduce is exact: every partial becomes a 64-bit integer count of 2^-32 (round to
    nearest even), the integers add up (order does not matter), and the total is rounded once to
    float32 and scaled back (`fixed_point_sum`); the CUDA worker adds them with atomics.
  - a split-K piece (columns [part_start, +part_count) of a row) is its own lane sum over those
    columns, lane 0 taking the piece's first 8; the second piece lands in the side vector, and a
    consumer adds it as qkv + qkv_side (h + h_side) in one rounding.
  - rmsnorm(x): inv = 1 / sqrt(sum(x * x) / n + eps), the sum a tree (`norm_sum`: each quad of
    elements in order from +0, the 32 quads of a 128-element chunk folded in halves, the chunks
    added in order); the final norm gives (x * inv) * w, while the QKV and FFN tasks multiply
    x * w and scale their dot products by inv afterwards (`rmsnorm_deferred`).
  - RoPE uses the F32 cos/sin tables in weights.bin: a' = a*cos - b*sin, b' = a*sin + b*cos.
  - exp is the only function not correctly rounded: here numpy's float32 exp.
Matrices are BF16 or Q8_0 (planner.WEIGHT_FORMATS), both widened exactly to F32 before any
arithmetic, so the orders above hold for either; vectors and tables are F32; activations,
accumulators and the K/V cache are F32. Tasks of one wave only read what earlier waves wrote, so any order gives the same bits.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...errors import ContextOverflowError, ParameterError
from .opcodes import Op, attn_chunk_positions, attn_span
from .planner import Q8_BLOCK, q8_down_block_bytes, q8_row_bytes, row_bytes
from .validator import act, attn_record, head_qkv_rows

F32 = np.float32


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(values)
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def q8_weights(quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Q8_0 weights in F32: int8 quants (rows, cols) times their block's scale, `scales` (rows,
    cols / 32) or one per element; each product is exact in F32 (an 11-bit times an 8-bit
    significand), so the worker's one rounded multiply gives the same value."""
    q = quants.view(np.int8).astype(F32)
    if scales.shape != q.shape:
        scales = np.repeat(scales, Q8_BLOCK, axis=1)
    return q * scales


def lane_sum(products: np.ndarray, lanes: int = 32, vec: int = 8) -> np.ndarray:
    """Sum each row of (R, K) products in the worker's warp order.

    Lane l owns the vec-element runs j with j % lanes == l (zero padded to a multiple of
    lanes * vec, which adds +0 and changes nothing); its accumulator starts at +0 and adds its
    runs' elements in increasing order; then the lanes fold in halves (l + lanes/2, ..., + 1).
    """
    rows, k = products.shape
    step = lanes * vec
    padded = -(-k // step) * step
    if padded != k:
        products = np.concatenate([products, np.zeros((rows, padded - k), F32)], axis=1)
    runs = products.reshape(rows, padded // step, lanes, vec).transpose(1, 3, 0, 2)  # (group, v, row, lane)
    acc = sequential_sum(np.ascontiguousarray(runs).reshape(-1, rows, lanes))
    while acc.shape[1] > 1:
        half = acc.shape[1] // 2
        acc = acc[:, :half] + acc[:, half:]
    return acc[:, 0]


def dot_rows(w: np.ndarray, x: np.ndarray, lanes: int = 32, vec: int = 8) -> np.ndarray:
    """(R, K) . (K,): each product rounded to float32, then summed by lane_sum."""
    return lane_sum(w * x, lanes, vec)


FIX_LIMIT = 2.0 ** 22  # |partial| below this: 512 of them cannot overflow the 64-bit sum
FIX_SCALE = 2.0 ** 32


class FixedPointRangeError(ParameterError):
    """An FFN partial is not finite or too large for the 64-bit fixed-point sum."""


def fixed_point_sum(parts: np.ndarray) -> np.ndarray:
    """Sum over axis 0, exactly: each float32 partial as round(v * 2^32) in int64, the integers
    added, the total rounded once to float32 and times 2^-32 (the worker's op_ffn atomics)."""
    parts = np.asarray(parts, dtype=np.float32)
    if not np.all(np.abs(parts) < FIX_LIMIT):
        raise FixedPointRangeError(f"an FFN partial of {float(np.max(np.abs(parts)))}, expected finite values "
                                   f"below {FIX_LIMIT:.0f} in magnitude (the fixed-point sum's range)")
    counts = np.rint(parts.astype(np.float64) * FIX_SCALE).astype(np.int64).sum(axis=0)
    return counts.astype(np.float32) * F32(1.0 / FIX_SCALE)


def sequential_sum(values: np.ndarray) -> np.ndarray:
    """Sum over axis 0 from +0 strictly in increasing index order."""
    acc = np.zeros(values.shape[1:], dtype=F32)
    for i in range(values.shape[0]):
        acc += values[i]
    return acc


def group_sum(products: np.ndarray, groups: int) -> np.ndarray:
    """Sum over axis 0 in `groups` strided groups (item i in group i % groups, each from +0 in
    increasing i), then the group sums in group order from +0."""
    n = products.shape[0]
    padded = -(-n // groups) * groups
    if padded != n:
        products = np.concatenate([products, np.zeros((padded - n, *products.shape[1:]), F32)])
    per_group = sequential_sum(products.reshape(padded // groups, groups, *products.shape[1:]))
    return sequential_sum(per_group)


def norm_sum(x: np.ndarray) -> np.float32:
    """sum(x * x) in the worker's order: quad q (elements 4q..4q+3) from +0 in element order, the
    32 quads of each 128-element chunk folded in halves (q + 16, ..., + 1), the chunks in order."""
    sq = np.zeros(-(-x.size // 128) * 128, F32)
    sq[:x.size] = x * x
    return sequential_sum(lane_sum(sq.reshape(-1, 128), 32, 4))  # a chunk is one lane sum of 4-runs


def norm_inverse(x: np.ndarray, eps: float) -> np.float32:
    return F32(1.0) / np.sqrt(norm_sum(x) / F32(x.size) + F32(eps))


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return (x * norm_inverse(x, eps)) * weight


def rmsnorm_deferred(x: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.float32]:
    """x * weight and the scale its dot products are multiplied by afterwards (the QKV and FFN
    tasks): dot(w, rmsnorm(x)) becomes dot(w, x * weight) * inv, one rounding apart."""
    return x * weight, norm_inverse(x, eps)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


class VM:
    """One plan, its weights (the bytes of weights.bin) and an F32 K/V cache."""

    name = "megakernel-vm"

    def __init__(self, plan, weights: np.ndarray):
        self.plan = plan
        self.k = k = plan.consts
        self.weights = weights
        self.w16 = weights.view(np.uint16)
        self._format = "q8_0" if self.k["weights_q8"] else "bf16"
        self.act = np.zeros(k["act_size"], F32)
        kv = (k["n_layers"], k["n_head_kv"], k["ctx"])
        self.kcache = np.zeros((*kv, k["head_dim"]), F32)  # (layer, kv_head, ctx, head_dim)
        self.vcache = np.zeros((*kv, k["head_dim_v"]), F32)
        self.n_ctx = k["ctx"]
        self.n_past = 0
        self.config = plan.config
        self.waves = np.searchsorted(plan.tasks["wave"], np.arange(k["n_waves"] + 1))
        self._ops = {Op.EMBED: self._embed, Op.QKV: self._qkv, Op.ATTN: self._attn, Op.WO: self._wo,
                     Op.FFN: self._ffn, Op.FFN_REDUCE: self._ffn_reduce, Op.FINAL_NORM: self._final_norm,
                     Op.LM_HEAD: self._lm_head}

    # ---- Backend-like use ---------------------------------------------------------------------
    def reset(self) -> None:
        self.n_past = 0
        self.kcache[:] = 0
        self.vcache[:] = 0

    def forward(self, tokens: Sequence[int], all_logits: bool = False, rng=None) -> np.ndarray:
        out = [self.step(int(t), self.n_past, rng)[0] for t in tokens]
        return np.stack(out) if all_logits else out[-1]

    def step(self, token: int, pos: int, rng: np.random.Generator | None = None) -> tuple[np.ndarray, int]:
        """Run one token at position `pos`; returns (logits, greedy token). `rng` shuffles each wave."""
        if not 0 <= pos < self.k["ctx"]:
            raise ContextOverflowError(f"position {pos}, expected 0..{self.k['ctx'] - 1} for this plan")
        if not 0 <= token < self.k["vocab"]:
            raise ParameterError(f"token {token}, expected 0..{self.k['vocab'] - 1}")
        self.token, self.pos = token, pos
        for w in range(self.k["n_waves"]):
            order = np.arange(self.waves[w], self.waves[w + 1])
            if rng is not None:
                rng.shuffle(order)
            for i in order:
                t = self.plan.tasks[i]
                self._ops[Op(int(t["opcode"]))](t)
        self.n_past = pos + 1
        return self.logits().copy(), self.greedy()

    def logits(self) -> np.ndarray:
        return self._region("logits", 0, self.k["vocab"])

    def greedy(self) -> int:
        """Combine the LM_HEAD candidates in slot order: largest value, lowest id among ties."""
        k = self.k
        cand = self._region("cand", 0, 2 * k["lm_parts"])
        values, ids = cand[0::2], cand[1::2].view(np.uint32)
        best = 0
        for s in range(1, k["lm_parts"]):
            if values[s] > values[best] or (values[s] == values[best] and ids[s] < ids[best]):
                best = s
        return int(ids[best])

    # ---- operand access -----------------------------------------------------------------------
    def _matrix(self, offset: int, rows: int, cols: int) -> np.ndarray:
        """(rows, cols) of a stored matrix from the row at byte `offset`, widened exactly to F32."""
        if not self.k["weights_q8"]:
            first = offset // 2
            return bf16_to_f32(self.w16[first:first + rows * cols]).reshape(rows, cols)
        stride = q8_row_bytes(cols)
        raw = self.weights[offset:offset + rows * stride].reshape(rows, stride)
        scales = raw[:, cols:cols + cols // 16].copy().view(np.float16).astype(F32)
        return q8_weights(raw[:, :cols], scales)

    def _down(self, offset: int, r0: int, n: int) -> np.ndarray:
        """Rows [r0, r0 + n) of the transposed ffn_down at byte `offset`: (n, n_embd) F32."""
        e = self.k["n_embd"]
        if not self.k["weights_q8"]:
            return self._matrix(offset + r0 * e * 2, n, e)
        block = q8_down_block_bytes(e)
        first, last = r0 // Q8_BLOCK, -(-(r0 + n) // Q8_BLOCK)
        raw = self.weights[offset + first * block:offset + last * block].reshape(last - first, block)
        quants = raw[:, :Q8_BLOCK * e].reshape(-1, e)  # (32 * blocks, n_embd)
        scales = raw[:, Q8_BLOCK * e:].copy().view(np.float16).astype(F32)  # (blocks, n_embd)
        rows = q8_weights(quants, np.repeat(scales, Q8_BLOCK, axis=0))
        return rows[r0 - first * Q8_BLOCK:r0 - first * Q8_BLOCK + n]

    def _f32(self, offset: int, count: int) -> np.ndarray:
        return self.weights[offset:offset + 4 * count].view(F32)

    def _region(self, name: str, start: int, count: int, layer: int = 0) -> np.ndarray:
        base = act(self.k, name, layer) + start
        return self.act[base:base + count]

    def _dot(self, w: np.ndarray, x: np.ndarray) -> np.ndarray:
        return dot_rows(w, x, self.k["dot_lanes"], self.k["dot_vec"])

    def _norm(self, x: np.ndarray, offset: int) -> np.ndarray:
        return rmsnorm(x, self._f32(offset, x.size), self.k["rms_eps"])

    def _norm_deferred(self, x: np.ndarray, offset: int) -> tuple[np.ndarray, np.float32]:
        return rmsnorm_deferred(x, self._f32(offset, x.size), self.k["rms_eps"])

    # ---- opcodes ------------------------------------------------------------------------------
    def _embed(self, t) -> None:
        e, r0, n = self.k["n_embd"], int(t["row_start"]), int(t["row_count"])
        row = self._matrix(int(t["weight0"]) + self.token * row_bytes(self._format, e), 1, e)[0, r0:r0 + n]
        scale = F32(self.k["embed_scale"])
        self._region("x", r0, n)[:] = row if scale == 1 else row * scale

    def _piece(self, t, x: np.ndarray) -> np.ndarray:
        """Rows [row_start, +row_count) of the task's matrix (row length x.size), columns
        [part_start, +part_count), dotted with the same columns of x."""
        r0, n, c0, cn = int(t["row_start"]), int(t["row_count"]), int(t["part_start"]), int(t["part_count"])
        rows = self._matrix(int(t["weight0"]) + r0 * row_bytes(self._format, x.size), n, x.size)
        return self._dot(np.ascontiguousarray(rows[:, c0:c0 + cn]), x[c0:c0 + cn])

    def _with_side(self, name: str, start: int, count: int, layer: int) -> np.ndarray:
        """qkv or h as consumers see it: the first pieces plus the side vector's second pieces."""
        return self._region(name, start, count, layer) + self._region(f"{name}_side", start, count, layer)

    def _qkv(self, t) -> None:
        r0, n, layer = int(t["row_start"]), int(t["row_count"]), int(t["layer"])
        x, inv = self._norm_deferred(self._region("x", 0, self.k["n_embd"], layer), int(t["norm"]))
        self._region("qkv_side" if int(t["side"]) else "qkv", r0, n, layer)[:] = self._piece(t, x) * inv

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """x: (heads, head_dim) at the current position, rotated by the package's tables."""
        k = self.k
        half = k["rope_dim"] // 2
        cos = self._f32(k["rope_cos"] + self.pos * half * 4, half)
        sin = self._f32(k["rope_sin"] + self.pos * half * 4, half)
        if k["rope_neox"]:
            ia, ib = np.arange(half), np.arange(half, 2 * half)
        else:
            ia, ib = np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)
        a, b = x[:, ia], x[:, ib]
        out = x.copy()
        out[:, ia] = a * cos - b * sin
        out[:, ib] = a * sin + b * cos
        return out

    def _attn(self, t) -> None:
        k = self.k
        chunk = int(t["slot"])
        first, last = attn_chunk_positions(k, chunk, self.pos)
        if first > self.pos:
            return  # chunk not active at this position
        layer, head = int(t["layer"]), int(t["head"])
        hd, g = k["head_dim"], k["n_head"] // k["n_head_kv"]
        q_rows, k_rows, v_rows = head_qkv_rows(k, head)
        q = self._rope(self._with_side("qkv", *q_rows, layer).reshape(g, hd))
        k_new = self._rope(self._with_side("qkv", *k_rows, layer).reshape(1, hd))[0]
        v_new = self._with_side("qkv", *v_rows, layer)
        if chunk == 0:  # the one writer of the current position's cache rows
            self.kcache[layer, head, self.pos] = k_new
            self.vcache[layer, head, self.pos] = v_new
        keys = self.kcache[layer, head, first:last].copy()
        values = self.vcache[layer, head, first:last].copy()
        keys[self.pos - first:] = k_new  # the current position comes from registers, not the cache
        values[self.pos - first:] = v_new
        rec = attn_record(k)
        out = self._region("attn", (chunk * k["n_head"] + head * g) * rec, g * rec, layer).reshape(g, rec)
        products = (q[:, None, :] * keys[None, :, :]).reshape(-1, hd)  # (g * positions, head_dim)
        scores = lane_sum(products, k["dot_lanes"], k["dot_vec"]).reshape(g, -1) * F32(k["attn_scale"])
        m = scores.max(axis=1)
        e = np.exp(scores - m[:, None])  # (g, positions)
        out[:, 0] = m
        out[:, 1] = lane_sum(e, 32, 1)
        groups = self.plan.target.threads_per_worker // k["head_dim_v"]
        out[:, 2:] = group_sum(e.T[:, :, None] * values[:, None, :], groups)  # over positions

    def _merged_attention(self, layer: int) -> np.ndarray:
        """Every query head's attention output from the active chunks' partials, (n_head * head_dim_v,)."""
        k = self.k
        active = self.pos // attn_span(k, self.pos) + 1
        rec = attn_record(k)
        parts = self._region("attn", 0, active * k["n_head"] * rec, layer).reshape(active, k["n_head"], rec)
        m = parts[:, :, 0].max(axis=0)
        scale = np.exp(parts[:, :, 0] - m)  # (active, n_head)
        total = sequential_sum(scale * parts[:, :, 1])
        o = sequential_sum(scale[:, :, None] * parts[:, :, 2:])
        return (o / total[:, None]).reshape(-1)

    def _wo(self, t) -> None:
        r0, n, layer = int(t["row_start"]), int(t["row_count"]), int(t["layer"])
        out = self._piece(t, self._merged_attention(layer))
        if int(t["side"]):
            self._region("h_side", r0, n, layer)[:] = out
        else:
            self._region("h", r0, n, layer)[:] = self._region("x", r0, n, layer) + out

    def _ffn(self, t) -> None:
        e, r0, n, layer = self.k["n_embd"], int(t["row_start"]), int(t["row_count"]), int(t["layer"])
        x, inv = self._norm_deferred(self._with_side("h", 0, e, layer), int(t["norm"]))
        row = row_bytes(self._format, e)
        gate = self._dot(self._matrix(int(t["weight0"]) + r0 * row, n, e), x) * inv
        up = self._dot(self._matrix(int(t["weight1"]) + r0 * row, n, e), x) * inv
        h = silu(gate) * up
        down_t = self._down(int(t["weight2"]), r0, n)  # (rows, n_embd): columns of ffn_down
        threads, cols = self.plan.target.threads_per_worker, e // 8
        groups = threads // cols if cols < threads else 1
        p0, pn = int(t["part_start"]), int(t["part_count"])  # the output rows this task adds to
        out = self._region("ffn", int(t["slot"]) * e + p0, pn, layer)
        out[:] = group_sum(h[:, None] * down_t[:, p0:p0 + pn], groups)

    def _ffn_reduce(self, t) -> None:
        k, r0, n, layer = self.k, int(t["row_start"]), int(t["row_count"]), int(t["layer"])
        parts = self._region("ffn", 0, k["ffn_parts"] * k["n_embd"], layer).reshape(k["ffn_parts"], k["n_embd"])
        total = fixed_point_sum(parts[:, r0:r0 + n])
        self._region("x", r0, n, layer + 1)[:] = self._with_side("h", r0, n, layer) + total

    def _final_norm(self, t) -> None:
        e, r0, n = self.k["n_embd"], int(t["row_start"]), int(t["row_count"])
        x = self._norm(self._region("x", 0, e, self.k["n_layers"]), int(t["norm"]))
        self._region("xn", r0, n)[:] = x[r0:r0 + n]

    def _lm_head(self, t) -> None:
        e, r0, n, slot = self.k["n_embd"], int(t["row_start"]), int(t["row_count"]), int(t["slot"])
        logits = self._dot(self._matrix(int(t["weight0"]) + r0 * row_bytes(self._format, e), n, e),
                           self._region("xn", 0, e))
        self._region("logits", r0, n)[:] = logits
        best = int(np.argmax(logits))  # first maximum: lowest id among ties
        cand = self._region("cand", 2 * slot, 2)
        cand[0] = logits[best]
        cand[1:2].view(np.uint32)[0] = r0 + best
