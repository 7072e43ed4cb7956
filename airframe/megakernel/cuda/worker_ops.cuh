// worker_ops.cuh: one function per opcode the worker runs, in the order of a layer's waves
// (embedding, QKV, attention, WO, FFN, final norm, LM head; the FFN reduce waves are skipped).
// worker.cu runs them.
#pragma once
#include "worker_base.cuh"
#include "worker_sample.cuh"

// ---- opcodes ------------------------------------------------------------------------------
// (tok: the arena of a prefill block's token; a decode step's is 0)
__device__ void op_embed(const af_args& a, const af_task& t, uint32_t token, uint32_t tok = 0) {
    const af_plan_consts& c = a.c;
#if AF_Q8
    const uint8_t* row = a.weights + t.weight0 + (size_t)token * q8_row_bytes(c.n_embd);
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(row + c.n_embd);
#else
    const uint16_t* row = reinterpret_cast<const uint16_t*>(a.weights + t.weight0) + (size_t)token * c.n_embd;
#endif
    float* out = x_at(a, 0, tok);
    for (uint32_t r = t.row_start + threadIdx.x; r < t.row_start + t.row_count; r += AF_THREADS) {
#if AF_Q8
        const float v = q8_weight(f16_float(__ldg(scales + r / 32)), make_uint2(__ldg(row + r), 0u), 0);
#else
        const float v = __uint_as_float((uint32_t)__ldg(row + r) << 16);
#endif
        out[r] = c.embed_scale == 1.0f ? v : __fmul_rn(v, c.embed_scale);
    }
}

// The weight rows a task multiplies, as gemv_list walks them (rows_of(t).n == 0: none). QKV and
// WO: rows [row_start, +row_count) of the matrix, columns [part_start, +part_count) of each (a
// split-K piece, or the whole row), lane 0 taking the piece's first 8 columns as the VM; FFN: the
// task's gate rows, then its up rows; LM_HEAD: its rows of the output matrix.
#if AF_Q8
// (Q8: a row of k columns is q8_row_bytes(k) bytes; a piece starts at vector part / 8 of its rows.)
__device__ af_rows rows_of(const af_args& a, const af_task& t) {
    const af_plan_consts& c = a.c;
    const uint8_t* w0 = a.weights + t.weight0;
    uint32_t k = 0, part = 0, count = 0;
    switch (t.opcode) {
        case AF_OP_FFN: {
            const uint32_t rb = q8_row_bytes(c.n_embd);
            const uint8_t* up = a.weights + t.weight1;
            return af_rows{w0 + (size_t)t.row_start * rb, up + (size_t)t.row_start * rb, t.row_count,
                           2 * t.row_count, rb, c.n_embd / 8, 0, c.n_embd};
        }
        case AF_OP_QKV: k = c.n_embd; part = t.part_start; count = t.part_count; break;
        case AF_OP_WO: k = c.n_head * c.head_dim_v; part = t.part_start; count = t.part_count; break;
        case AF_OP_LM_HEAD: k = c.n_embd; part = 0; count = c.n_embd; break;
        default: return af_rows{w0, w0, 0, 0, 0, 0, 0, 0};
    }
    const uint8_t* m = w0 + (size_t)t.row_start * q8_row_bytes(k);
    return af_rows{m, m, t.row_count, t.row_count, q8_row_bytes(k), count / 8, part / 8, k};
}
#else
__device__ af_rows rows_of(const af_args& a, const af_task& t) {
    const af_plan_consts& c = a.c;
    const uint4* w0 = reinterpret_cast<const uint4*>(a.weights + t.weight0);
    uint32_t k = 0, part = 0, count = 0;
    switch (t.opcode) {
        case AF_OP_FFN: {
            const uint32_t cols = c.n_embd / 8;
            const uint4* up = reinterpret_cast<const uint4*>(a.weights + t.weight1);
            return af_rows{w0 + (size_t)t.row_start * cols, up + (size_t)t.row_start * cols, t.row_count,
                           2 * t.row_count, cols, cols};
        }
        case AF_OP_QKV: k = c.n_embd; part = t.part_start; count = t.part_count; break;
        case AF_OP_WO: k = c.n_head * c.head_dim_v; part = t.part_start; count = t.part_count; break;
        case AF_OP_LM_HEAD: k = c.n_embd; part = 0; count = c.n_embd; break;
        default: return af_rows{w0, w0, 0, 0, 0, 0};
    }
    const uint4* m = w0 + (size_t)t.row_start * (k / 8) + part / 8;
    return af_rows{m, m, t.row_count, t.row_count, k / 8, count / 8};
}
#endif

// qkv[rows] (side: qkv_side[rows]) = the task's piece of W_qkv . rmsnorm(x[layer]). The V row at
// pos goes to the cache in the attention wave (chunk 0), from qkv + qkv_side.
__device__ void op_qkv(const af_args& a, const af_task& t, float* xs, float* red, bool xs_ready) {
    const af_plan_consts& c = a.c;
    float* out = layer_at(a, t.layer, t.side ? c.lay_qkv_side : c.lay_qkv);
    auto norm = [&] {
        if (!xs_ready) rmsnorm_shared<true>(xs, x_in(a, t.layer), f32_at(a, t.norm), c.n_embd, c.rms_eps, red);
    };
    gemv_list<AF_UNROLL>(rows_of(a, t), xs + AF_XS_STEP * (t.part_start / 8), norm, [&](uint32_t i, float v) {
        out[t.row_start + i] = __fmul_rn(v, norm_scale(red, c.n_embd, c.rms_eps));  // the norm's scale
    });
}

// Element i of one head (hd floats at src + side) with RoPE at `pos` applied, into dst[i], with
// the package's tables.
__device__ void rope_head(float* dst, const float* src, const float* side, const af_args& a, uint32_t pos,
                          uint32_t i) {
    const af_plan_consts& c = a.c;
    const uint32_t half = c.rope_dim / 2;
    if (i >= c.head_dim) return;
    const bool sl = side_live(1);
    const float x = __fadd_rn(ld_act(src + i), ld_side(side + i, sl));
    float y = x;
    const bool neox = c.rope_neox != 0;
    const uint32_t pair = neox ? (i < half ? i : i - half) : i / 2;
    const bool first = neox ? i < half : (i % 2) == 0;
    if (i < c.rope_dim) {
        const float cs = __ldg(f32_at(a, c.rope_cos) + (size_t)pos * half + pair);
        const float sn = __ldg(f32_at(a, c.rope_sin) + (size_t)pos * half + pair);
        const uint32_t other = neox ? (first ? i + half : i - half) : (first ? i + 1 : i - 1);
        const float o = __fadd_rn(ld_act(src + other), ld_side(side + other, sl));
        // a' = a cos - b sin, b' = a sin + b cos, each product rounded (as the VM)
        y = first ? __fsub_rn(__fmul_rn(x, cs), __fmul_rn(o, sn)) : __fadd_rn(__fmul_rn(o, sn), __fmul_rn(x, cs));
    }
    dst[i] = y;
}

// The flash-decoding partial (m, l, o) of task t's K/V head over positions [first, first + n) for
// the g query heads q (roped, in shared memory) of the token at pos, into chunk t.slot's records of
// token tok's arena. Positions from b0 on (pos itself in a decode step; the prefill block's in a
// prefill step) come from kb and vb (their roped K rows and V rows, b0's first), never from the
// cache: their writers may be filling it in this wave. s: the scratch after q, k and v.
// Scores: head_dim/8 lanes per position, each an 8-element run, folded as the VM folds.
// l: lane-strided partials over positions, folded in halves. o: 1024/hdv position groups
// (position p in group p % groups), each in increasing p, then summed in group order.
__device__ void attn_chunk(const af_args& a, const af_task& t, uint32_t tok, uint32_t pos, uint32_t b0, uint32_t first,
                           uint32_t n, const float* q, const float* kb, const float* vb, float* s) {
    const af_plan_consts& c = a.c;
    const uint32_t hd = c.head_dim, hdv = c.head_dim_v, g = udiv(c.n_head, c.n_head_kv);
    const uint32_t groups = udiv(AF_THREADS, hdv);
    float* opart = s + g * c.attn_chunk;  // (groups, g, hdv)
    float* lsum = opart + groups * g * hdv;  // (g)
    float* mmax = lsum + g;                  // (g)
    const uint32_t lh = t.layer * c.n_head_kv + t.head;
    const uint32_t t_id = threadIdx.x;
    const float* kbase = a.kcache + (size_t)lh * c.ctx * hd;
    const float* vbase = a.vcache + (size_t)lh * c.ctx * hdv;
    // scores: lanes per position = hd / 8 (a power of two <= 32); values: thread (group, d)
    const uint32_t lpp = hd / 8, per_warp = udiv(32, lpp);
    const uint32_t lane = t_id % 32, warp = t_id / 32, sub = udiv(lane, lpp), vl = umod(lane, lpp);
    const uint32_t d = umod(t_id, hdv), grp = udiv(t_id, hdv);
    // the chunk's positions below b0 come from the cache, the rest (its last ones) from kb and vb
    const uint32_t cached = b0 > first ? min(n, b0 - first) : 0;

    // Few positions (n <= 32 at head_dim 64, g = 4): warp w takes query head w % g of the positions
    // from (w / g) * per_warp on, so that the g heads' scores are computed side by side rather than
    // one after another in the same warps; the same arithmetic either way.
    const bool apart = n <= per_warp * udiv(AF_WARPS, g);
    const uint32_t j0 = apart ? umod(warp, g) : 0, j1 = apart ? j0 + 1 : g;
    for (uint32_t p0 = apart ? udiv(warp, g) * per_warp : warp * per_warp; p0 < n;
         p0 += apart ? n : AF_WARPS * per_warp) {
        const uint32_t p = p0 + sub;
        const bool live = p < n;
        const uint32_t abs_p = first + (live ? p : 0);
        float k8[8];
        if (abs_p >= b0) {
#pragma unroll
            for (int e = 0; e < 8; ++e) k8[e] = kb[(abs_p - b0) * hd + vl * 8 + e];
        } else {
            const float4 k0 = ld_act4(kbase + (size_t)abs_p * hd + vl * 8);
            const float4 k1 = ld_act4(kbase + (size_t)abs_p * hd + vl * 8 + 4);
            k8[0] = k0.x; k8[1] = k0.y; k8[2] = k0.z; k8[3] = k0.w;
            k8[4] = k1.x; k8[5] = k1.y; k8[6] = k1.z; k8[7] = k1.w;
        }
        for (uint32_t j = j0; j < j1; ++j) {
            float acc = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = madd(acc, k8[e], q[j * hd + vl * 8 + e]);
            for (uint32_t off = lpp / 2; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
            if (live && vl == 0) s[j * c.attn_chunk + p] = __fmul_rn(acc, c.attn_scale);
        }
    }
    __syncthreads();
    trace_mark(3);
    // max and exp-sum per query head: warp j
    if (warp < g) {
        float m = -INFINITY;
        for (uint32_t p = lane; p < n; p += 32) m = fmaxf(m, s[warp * c.attn_chunk + p]);
        m = warp_max(m);
        float l = 0.0f;
        for (uint32_t p = lane; p < n; p += 32) {
            const float e = expf(__fsub_rn(s[warp * c.attn_chunk + p], m));
            s[warp * c.attn_chunk + p] = e;
            l = __fadd_rn(l, e);
        }
        l = warp_fold(l);
        if (lane == 0) {
            lsum[warp] = l;
            mmax[warp] = m;
        }
    }
    __syncthreads();
    trace_mark(4);
    // weighted values; the positions from kb and vb, the largest of their groups, are added after
    // the cached ones. With fewer positions than groups the groups past n hold none: they are
    // neither written nor read, and the sum below adds the +0 they would have added once.
    const uint32_t used = min(groups, n);
    if (grp < used) {
        float acc[AF_MAX_GROUP];
#pragma unroll
        for (int j = 0; j < AF_MAX_GROUP; ++j) acc[j] = 0.0f;
        for (uint32_t p0 = grp; p0 < cached; p0 += 4 * groups) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint32_t p = p0 + u * groups;
                v[u] = p < cached ? ld_act(vbase + (size_t)(first + p) * hdv + d) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint32_t p = p0 + u * groups;
                if (p >= cached) break;
#pragma unroll
                for (int j = 0; j < AF_MAX_GROUP; ++j)
                    if (j < (int)g) acc[j] = madd(acc[j], s[j * c.attn_chunk + p], v[u]);
            }
        }
        for (uint32_t p = cached; p < n; ++p) {
            if (umod(p, groups) != grp) continue;
            const float v = vb[(first + p - b0) * hdv + d];
#pragma unroll
            for (int j = 0; j < AF_MAX_GROUP; ++j)
                if (j < (int)g) acc[j] = madd(acc[j], s[j * c.attn_chunk + p], v);
        }
#pragma unroll
        for (int j = 0; j < AF_MAX_GROUP; ++j)
            if (j < (int)g) opart[(grp * g + j) * hdv + d] = acc[j];
    }
    __syncthreads();
    trace_mark(5);
    const uint32_t rec = hdv + 2;
    float* out = layer_at(a, t.layer, c.lay_attn, tok) + (size_t)(t.slot * c.n_head + t.head * g) * rec;
    for (uint32_t i = t_id; i < g * hdv; i += AF_THREADS) {
        const uint32_t j = udiv(i, hdv), dd = umod(i, hdv);
        float o = 0.0f;
        for (uint32_t k = 0; k < used; ++k) o = __fadd_rn(o, opart[(k * g + j) * hdv + dd]);
        if (used < groups) o = __fadd_rn(o, 0.0f);
        out[j * rec + 2 + dd] = o;
    }
    if (t_id < g) {
        out[t_id * rec] = mmax[t_id];
        out[t_id * rec + 1] = lsum[t_id];
    }
}

// The scratch of one attention task in sm: q (g, hd) roped, then (decode) the new K and V rows
// or (prefill) the block's, then attn_chunk's scores and value groups.
struct af_attn_room {
    float* q;
    float* kb;
    float* vb;
    float* s;
    __device__ __forceinline__ af_attn_room(const af_plan_consts& c, float* sm, uint32_t rows) {
        q = sm;
        kb = q + udiv(c.n_head, c.n_head_kv) * c.head_dim;
        vb = kb + rows * c.head_dim;
        s = vb + rows * c.head_dim_v;
    }
};

// Rows [row0, +hd) of token tok's qkv + qkv_side in layer t.layer where a query head of task t's
// group (j < g) or its K row (j == g) lives; the V row is after the K rows.
__device__ __forceinline__ uint32_t head_row(const af_plan_consts& c, const af_task& t, uint32_t j, uint32_t g) {
    return j < g ? (t.head * g + j) * c.head_dim : c.n_head * c.head_dim + t.head * c.head_dim;
}

// One K/V head, one chunk of positions, g query heads: the flash-decoding partial (m, l, o).
// q, k and v at pos come from qkv + qkv_side; chunk 0 writes K and V at pos to the caches, and
// every chunk takes them from shared memory, never from the cache (chunk 0 may be writing it).
__device__ void op_attn(const af_args& a, const af_task& t, uint32_t pos, float* sm) {
    const af_plan_consts& c = a.c;
    const uint32_t span = af_span(), first = t.slot * span;
    if (first > pos) {  // chunk not active at this position
        if (AF_TRACE_MARK > 1) trace_mark(AF_TRACE_MARK);  // every phase ends here
        return;
    }
    trace_mark(6);
    const uint32_t hd = c.head_dim, hdv = c.head_dim_v, g = udiv(c.n_head, c.n_head_kv);
    const uint32_t n = min(span, pos + 1 - first);
    const float* qkv = layer_at(a, t.layer, c.lay_qkv);
    const float* side = layer_at(a, t.layer, c.lay_qkv_side);
    const af_attn_room room(c, sm, 1);
    const uint32_t t_id = threadIdx.x;
    // thread j * hd + i ropes element i of query head j, the next hd threads the new key, the
    // next hdv copy the new value
    const uint32_t v_row = (c.n_head + c.n_head_kv) * hd + t.head * hdv;
    if (t_id < (g + 1) * hd) {
        const uint32_t j = udiv(t_id, hd), row = head_row(c, t, j, g);
        rope_head(j < g ? room.q + j * hd : room.kb, qkv + row, side + row, a, pos, t_id - j * hd);
    } else if (t_id < (g + 1) * hd + hdv) {
        const uint32_t d = t_id - (g + 1) * hd;
        room.vb[d] = __fadd_rn(ld_act(qkv + v_row + d), ld_side(side + v_row + d, side_live(1)));
    }
    __syncthreads();
    trace_mark(2);
    const uint32_t lh = t.layer * c.n_head_kv + t.head;
    if (t.slot == 0 && t_id < hd) a.kcache[((size_t)lh * c.ctx + pos) * hd + t_id] = room.kb[t_id];
    if (t.slot == 0 && t_id >= hd && t_id < hd + hdv) a.vcache[((size_t)lh * c.ctx + pos) * hdv + t_id - hd] = room.vb[t_id - hd];
    attn_chunk(a, t, 0, pos, pos, first, n, room.q, room.kb, room.vb, room.s);
}

// The merge when one attention chunk is active (pos below the span): that chunk's max is
// m, so its scale is expf(0) = 1 and merge_attention's sums give total = l, o = 0 + o; xs =
// (0 + o) / l, the same bits, two elements per thread (records are 8-byte aligned: hdv is even).
__device__ __forceinline__ void merge_one_chunk(const af_args& a, uint32_t layer, float* xs, uint32_t tok = 0) {
    const af_plan_consts& c = a.c;
    const uint32_t hdv = c.head_dim_v, rec = hdv + 2;
    const float* parts = layer_at(a, layer, c.lay_attn, tok);
    for (uint32_t i = 2 * threadIdx.x; i < c.n_head * hdv; i += 2 * AF_THREADS) {
        const uint32_t h = udiv(i, hdv), d = umod(i, hdv);
        const float* r = parts + (size_t)h * rec;
        const float l = ld_act(r + 1);
        const float2 o = __ldcg(reinterpret_cast<const float2*>(r + 2 + d));
        // (i is even: elements i and i + 1 sit side by side in one plane)
        *reinterpret_cast<float2*>(xs + xs_index(i)) = make_float2(__fdiv_rn(__fadd_rn(0.0f, o.x), l),
                                                         __fdiv_rn(__fadd_rn(0.0f, o.y), l));
    }
    __syncthreads();
}

// Merge the active chunks' partials for every query head into xs (n_head * hdv), as the VM, four
// chunks at a time per element (inside the call merge_chunks, not in op_wo: see there).
__device__ __forceinline__ void merge_attention(const af_args& a, uint32_t layer, uint32_t pos, float* xs,
                                                uint32_t tok) {
    const af_plan_consts& c = a.c;
    const uint32_t hdv = c.head_dim_v, rec = hdv + 2, active = active_chunks(pos);
    const float* parts = layer_at(a, layer, c.lay_attn, tok);
    constexpr uint32_t near = 4;  // up to this many chunks, every load is issued before any math
    for (uint32_t i = threadIdx.x; i < c.n_head * hdv; i += AF_THREADS) {
        const uint32_t h = udiv(i, hdv), d = umod(i, hdv);
        float m = -INFINITY, total = 0.0f, o = 0.0f;
        // chunks ch0 .. ch0 + near - 1: (m, l, o) requested together, then added in chunk order
        float mc[near], lc[near], oc[near];
        auto load = [&](uint32_t ch0) {
#pragma unroll
            for (uint32_t u = 0; u < near; ++u) {
                const float* r = parts + (size_t)((ch0 + u) * c.n_head + h) * rec;
                const bool live = ch0 + u < active;
                mc[u] = live ? ld_act(r) : 0.0f;
                lc[u] = live ? ld_act(r + 1) : 0.0f;
                oc[u] = live ? ld_act(r + 2 + d) : 0.0f;
            }
        };
        auto add = [&](uint32_t ch0) {
#pragma unroll
            for (uint32_t u = 0; u < near; ++u) {
                if (ch0 + u >= active) break;
                const float scale = expf(__fsub_rn(mc[u], m));
                total = __fadd_rn(total, __fmul_rn(scale, lc[u]));
                o = __fadd_rn(o, __fmul_rn(scale, oc[u]));
            }
        };
        if (active <= near) {  // one round trip to L2 instead of two
            load(0);
#pragma unroll
            for (uint32_t u = 0; u < near; ++u)
                if (u < active) m = fmaxf(m, mc[u]);
            add(0);
        } else {  // the max over all chunks first; the loads of both passes `near` chunks at a time
            for (uint32_t ch0 = 0; ch0 < active; ch0 += near) {
#pragma unroll
                for (uint32_t u = 0; u < near; ++u)
                    mc[u] = ch0 + u < active ? ld_act(parts + (size_t)((ch0 + u) * c.n_head + h) * rec) : 0.0f;
#pragma unroll
                for (uint32_t u = 0; u < near; ++u)
                    if (ch0 + u < active) m = fmaxf(m, mc[u]);
            }
            for (uint32_t ch0 = 0; ch0 < active; ch0 += near) {
                load(ch0);
                add(ch0);
            }
        }
        xs[xs_index(i)] = __fdiv_rn(o, total);
    }
    __syncthreads();
}

// The merge of several chunks with every partial in shared memory: the active
// chunks' records are copied at once (cp.async, one round trip to L2 where merge_attention makes
// two per batch of four chunks and element), then per head its max m over the chunks, each
// chunk's scale expf(m_c - m) once (merge_attention computes the same value for every element),
// the sum of scale * l in chunk order, and per element the sum of scale * o in chunk order over
// that: merge_attention's arithmetic, the same bits. Returns false, doing nothing, when the
// records do not fit in the `room` floats of scratch at st (the host reserves the room where the
// GPU has it).
__device__ __forceinline__ bool merge_staged(const af_args& a, uint32_t layer, uint32_t pos, float* xs, uint32_t tok,
                                             float* st, uint32_t room) {
    const af_plan_consts& c = a.c;
    const uint32_t hdv = c.head_dim_v, rec = hdv + 2, active = active_chunks(pos), heads = c.n_head;
    const uint32_t n = active * heads * rec, n4 = (n + 3) & ~3u;
    // st: the opcodes' scratch, `room` floats: (active, heads, rec)
    if (n4 + heads * (active + 2) > room) return false;
    float* scale = st + n4;                       // (heads, active)
    float* mx = scale + heads * active;           // (heads): the max, then the sum of scale * l
    const float* parts = layer_at(a, layer, c.lay_attn, tok);  // 256-byte aligned, records back to back
    for (uint32_t i = threadIdx.x; i < n / 4; i += AF_THREADS) cp_async16(st + 4 * i, parts + 4 * i);
    for (uint32_t i = n / 4 * 4 + threadIdx.x; i < n; i += AF_THREADS) st[i] = ld_act(parts + i);
    cp_async_wait_all();
    __syncthreads();
    for (uint32_t h = threadIdx.x; h < heads; h += AF_THREADS) {
        float m = -INFINITY;
        for (uint32_t ch = 0; ch < active; ++ch) m = fmaxf(m, st[(ch * heads + h) * rec]);
        mx[h] = m;
    }
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < heads * active; j += AF_THREADS) {
        const uint32_t h = udiv(j, active), ch = j - h * active;
        scale[j] = expf(__fsub_rn(st[(ch * heads + h) * rec], mx[h]));
    }
    __syncthreads();
    for (uint32_t h = threadIdx.x; h < heads; h += AF_THREADS) {
        float total = 0.0f;
        for (uint32_t ch = 0; ch < active; ++ch)
            total = __fadd_rn(total, __fmul_rn(scale[h * active + ch], st[(ch * heads + h) * rec + 1]));
        mx[h] = total;
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < heads * hdv; i += AF_THREADS) {
        const uint32_t h = udiv(i, hdv), d = umod(i, hdv);
        float o = 0.0f;
        for (uint32_t ch = 0; ch < active; ++ch)
            o = __fadd_rn(o, __fmul_rn(scale[h * active + ch], st[(ch * heads + h) * rec + 2 + d]));
        xs[xs_index(i)] = __fdiv_rn(o, mx[h]);
    }
    __syncthreads();
    return true;
}

// The merge of two to four active chunks: like merge_one_chunk, two elements of
// one head per thread, every chunk's (m, l) and o pair requested at once (one round trip to L2),
// each chunk's scale computed once for both; merge_attention's arithmetic, the same bits.
__device__ __forceinline__ void merge_few(const af_args& a, uint32_t layer, uint32_t active, float* xs, uint32_t tok) {
    const af_plan_consts& c = a.c;
    const uint32_t hdv = c.head_dim_v, rec = hdv + 2;
    const float* parts = layer_at(a, layer, c.lay_attn, tok);
    for (uint32_t i = 2 * threadIdx.x; i < c.n_head * hdv; i += 2 * AF_THREADS) {
        const uint32_t h = udiv(i, hdv), d = umod(i, hdv);
        float mc[4], lc[4];
        float2 oc[4];
#pragma unroll
        for (uint32_t u = 0; u < 4; ++u) {
            const float* r = parts + (size_t)(u * c.n_head + h) * rec;
            const bool live = u < active;
            mc[u] = live ? ld_act(r) : -INFINITY;
            lc[u] = live ? ld_act(r + 1) : 0.0f;
            oc[u] = live ? __ldcg(reinterpret_cast<const float2*>(r + 2 + d)) : make_float2(0.0f, 0.0f);
        }
        float m = -INFINITY;
#pragma unroll
        for (uint32_t u = 0; u < 4; ++u)
            if (u < active) m = fmaxf(m, mc[u]);
        float total = 0.0f, o0 = 0.0f, o1 = 0.0f;
#pragma unroll
        for (uint32_t u = 0; u < 4; ++u) {
            if (u >= active) break;
            const float scale = expf(__fsub_rn(mc[u], m));
            total = __fadd_rn(total, __fmul_rn(scale, lc[u]));
            o0 = __fadd_rn(o0, __fmul_rn(scale, oc[u].x));
            o1 = __fadd_rn(o1, __fmul_rn(scale, oc[u].y));
        }
        // (i is even: elements i and i + 1 sit side by side in one plane)
        *reinterpret_cast<float2*>(xs + xs_index(i)) = make_float2(__fdiv_rn(o0, total), __fdiv_rn(o1, total));
    }
    __syncthreads();
}

// The merge of two or more active chunks: up to four by merge_few, past four staged where it
// fits, else four chunks at a time.
// Not inlined: inside op_wo the merges' loops left the worker 120-150 B of register spills at 64
// registers per thread (ptxas -v); as one call, neither it nor the worker spills (sm_90, sm_86).
__device__ __noinline__ void merge_chunks(const af_args& a, uint32_t layer, uint32_t pos, float* xs, uint32_t tok,
                                          float* st, uint32_t room) {
    const uint32_t active = active_chunks(pos);
    if (active <= 4 && a.c.head_dim_v % 2 == 0) merge_few(a, layer, active, xs, tok);
    else if (!(active > 4 && merge_staged(a, layer, pos, xs, tok, st, room))) merge_attention(a, layer, pos, xs, tok);
}

// h[rows] = x[layer][rows] + the task's piece of W_o . merged attention; a side piece goes to
// h_side[rows] with no residual.
__device__ void op_wo(const af_args& a, const af_task& t, uint32_t pos, float* xs, bool xs_ready) {
    const af_plan_consts& c = a.c;
    float* h = layer_at(a, t.layer, t.side ? c.lay_h_side : c.lay_h);
    auto merge = [&] {
        if (xs_ready) return;
        if (pos < af_span() && c.head_dim_v % 2 == 0) merge_one_chunk(a, t.layer, xs);
        else merge_chunks(a, t.layer, pos, xs, 0, xs + AF_SM_OFFSET, a.table_offset - AF_SM_OFFSET);
    };
    gemv_list<AF_UNROLL>(rows_of(a, t), xs + AF_XS_STEP * (t.part_start / 8), merge,
              [&](uint32_t i, float v) {
                  const uint32_t r = t.row_start + i;
                  // (x and the accumulators found here, not held in registers across the GEMV)
                  h[r] = t.side ? v : __fadd_rn(x_in(a, t.layer).at(r, c.n_embd), v);
                  // (a wave before this layer's FFN adds to the sums)
#pragma unroll
                  for (int k = 0; k < AF_FFN_COPIES; ++k) ffn_acc(a, t.layer)[k * c.n_embd + r] = 0ull;
              });
}

// The FFN input of token tok, as its readers see it: h + h_side of the layer.
__device__ __forceinline__ af_x ffn_in(const af_args& a, uint32_t layer, uint32_t tok) {
    const af_plan_consts& c = a.c;
    return af_x{layer_at(a, layer, c.lay_h, tok), layer_at(a, layer, c.lay_h_side, tok), !side_live(2), nullptr};
}

__device__ void ffn_down(const af_args& a, const af_task& t, float* h, const float* up, float* part, const float* red);

// gate and up rows of rmsnorm(h + h_side), then ffn_down's work.
__device__ void op_ffn(const af_args& a, const af_task& t, float* xs, float* red, float* sm, bool xs_ready) {
    const af_plan_consts& c = a.c;
    float* h = sm;                        // (row_count): gate, then silu(gate) * up
    float* up = sm + a.ffn_max_rows;      // (row_count)
    const uint32_t n = t.row_count;
    gemv_list<AF_UNROLL>(rows_of(a, t), xs,
              [&] {
                  if (!xs_ready) rmsnorm_shared<true>(xs, ffn_in(a, t.layer, 0), f32_at(a, t.norm), c.n_embd, c.rms_eps, red);
              },
              [&](uint32_t i, float v) {
                  if (i < n) h[i] = v;
                  else up[i - n] = v;
              });
    ffn_down(a, t, h, up, up + a.ffn_max_rows, red);
}

// silu(gate) * up of task t's FFN rows (h: the gate rows' sums, up: the up rows', red: its norm's
// chunk sums, whose scale they still lack) into h; then the task's columns of ffn_down (stored
// transposed, one row of n_embd per FFN row), output rows [part_start, +part_count) only, times h,
// into the step's FFN sums. The down sum: `groups` row groups (row i in group i % groups), each in
// increasing row order, then summed in group order (part: (groups, n_embd)); pf_down is its
// prefill twin.
__device__ void ffn_down(const af_args& a, const af_task& t, float* h, const float* up, float* part, const float* red) {
    const af_plan_consts& c = a.c;
    const uint32_t e = c.n_embd, cols = e / 8;
    const uint32_t n = t.row_count;
    trace_mark(7);
    const uint32_t groups = cols >= AF_THREADS ? 1 : udiv(AF_THREADS, cols);
    const uint32_t grp = udiv(threadIdx.x, cols);
#if AF_Q8
    const uint8_t* down = a.weights + t.weight2;  // blocks of 32 rows (q8_down_block)
#else
    const uint4* down = reinterpret_cast<const uint4*>(a.weights + t.weight2 + (size_t)t.row_start * e * 2);
#endif
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < n; i += AF_THREADS) {
        // the norm's scale, left out of xs (rmsnorm_shared<true>), applied to gate and up here
        const float inv = norm_scale(red, e, c.rms_eps);
        h[i] = silu_up(h[i], up[i], inv);
    }
    __syncthreads();
    const uint32_t col_lo = t.part_start / 8, col_hi = (t.part_start + t.part_count) / 8;
    if (grp < groups) {
        for (uint32_t col = umod(threadIdx.x, cols); col < cols; col += (cols >= AF_THREADS ? AF_THREADS : cols)) {
            if (col < col_lo || col >= col_hi) continue;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            uint32_t i = grp;
#if AF_Q8
            // Block by block (32 FFN rows share a column's scale): the block's 8 scales of this
            // column are requested with its first rows' quants and converted once, then its rows
            // of this group go AF_DOWN_UNROLL at a time, in increasing order as ever.
            while (i < n) {
                const uint32_t f = t.row_start + i;
                const uint8_t* block = down + q8_down_block(e, f);
                const uint32_t end = min((f | 31u) + 1 - t.row_start, n);  // past the block's rows
                uint2 w[AF_DOWN_UNROLL];
                float sc[8];
                auto load = [&] {
#pragma unroll
                    for (int u = 0; u < AF_DOWN_UNROLL; ++u) {
                        const uint32_t iu = i + u * groups;
                        w[u] = iu < end ? ld_weight8(block + q8_down_quants(e, t.row_start + iu, col)) : make_uint2(0, 0);
                    }
                };
                auto add = [&] {
#pragma unroll
                    for (int u = 0; u < AF_DOWN_UNROLL; ++u) {
                        if (i < end) {
                            madd8q(acc, w[u], sc, h[i]);
                            i += groups;
                        }
                    }
                };
                const uint4 raw = ld_weight16(block + q8_down_scales(e, col));
                load();
                const uint32_t rw[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    sc[2 * k] = f16_float(rw[k]);
                    sc[2 * k + 1] = f16_float(rw[k] >> 16);
                }
                add();
                while (i < end) {
                    load();
                    add();
                }
            }
#else
            for (; i + (AF_DOWN_UNROLL - 1) * groups < t.row_count; i += AF_DOWN_UNROLL * groups) {
                uint4 w[AF_DOWN_UNROLL];
#pragma unroll
                for (int u = 0; u < AF_DOWN_UNROLL; ++u) w[u] = ld_weight16(down + (size_t)(i + u * groups) * cols + col);
#pragma unroll
                for (int u = 0; u < AF_DOWN_UNROLL; ++u) madd8(acc, w[u], h[i + u * groups]);
            }
            for (; i < t.row_count; i += groups) madd8(acc, ld_weight16(down + (size_t)i * cols + col), h[i]);
#endif
#pragma unroll
            for (int k = 0; k < 8; ++k) part[grp * e + col * 8 + k] = acc[k];
        }
    }
    __syncthreads();
    trace_mark(8);
    // The partials into the layer's fixed-point sums: each output row's value as round(v * 2^32),
    // added to its 64-bit accumulator with red.global.add.u64 instead of being written to a slot.
    // Integer sums do not depend on their order, so the total is the VM's exact FFN_REDUCE on
    // every run, and the plan's FFN reduce waves and their barriers are skipped (load_table). A
    // partial that is not finite or has |v| >= 2^22 (it could overflow the accumulator) sets bit 1
    // of the error word.
    unsigned long long* acc = ffn_acc(a, t.layer) + (size_t)(blockIdx.x % AF_FFN_COPIES) * e;
    bool bad = false;
    for (uint32_t i = t.part_start + threadIdx.x; i < t.part_start + t.part_count; i += AF_THREADS) {
        float v = part[i];
        for (uint32_t k = 1; k < groups; ++k) v = __fadd_rn(v, part[k * e + i]);
        fix_add(acc + i, v, bad);
    }
    if (bad) atomicOr(&a.ctl->error, 2u);
    if (AF_TRACE_MARK == 9) {  // (the atomics' completion, as the barrier's release waits for it)
        __threadfence();
        __syncthreads();
        trace_mark(9);
    }
}

__device__ void op_final_norm(const af_args& a, const af_task& t, float* xs, float* red) {
    const af_plan_consts& c = a.c;
    rmsnorm_shared<false>(xs, x_in(a, c.n_layers), f32_at(a, t.norm), c.n_embd, c.rms_eps, red);
    for (uint32_t r = t.row_start + threadIdx.x; r < t.row_start + t.row_count; r += AF_THREADS)
        a.act[c.act_xn + r] = xs[xs_index(r)];
}

// Logits of this task's rows; its candidate slot gets the largest logit, lowest id among ties.
// A non-finite logit sets bit 0 of the error word.
__device__ void op_lm_head(const af_args& a, const af_task& t, uint32_t step, float* xs, float* sm) {
    const af_plan_consts& c = a.c;
    float* best_v = sm;  // (warps)
    uint32_t* best_i = reinterpret_cast<uint32_t*>(sm + AF_WARPS);
    float* logits = a.act + c.act_logits;
    float* all = a.logits_all ? a.logits_all + (size_t)step * c.vocab : nullptr;
    float bv = -INFINITY;
    uint32_t bi = 0xffffffffu;
    bool bad = false;
    auto fill = [&] {
        load_shared(xs, a.act + c.act_xn, c.n_embd);
        __syncthreads();
    };
    gemv_list<AF_UNROLL>(rows_of(a, t), xs, fill, [&](uint32_t i, float v) {
        const uint32_t r = t.row_start + i;
        logits[r] = v;
        if (all) all[r] = v;
        if (!isfinite(v)) bad = true;
        if (v > bv || bi == 0xffffffffu) {  // rows come in increasing order per warp
            bv = v;
            bi = r;
        }
    });
    if (bad) atomicOr(&a.ctl->error, 1u);
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = -INFINITY;
        uint32_t id = 0xffffffffu;
        for (uint32_t w = 0; w < AF_WARPS; ++w) {
            if (best_i[w] == 0xffffffffu) continue;
            if (id == 0xffffffffu || best_v[w] > v || (best_v[w] == v && best_i[w] < id)) {
                v = best_v[w];
                id = best_i[w];
            }
        }
        float* cand = a.act + c.act_cand + 2 * t.slot;
        cand[0] = v;
        cand[1] = __uint_as_float(id);
    }
    if (a.samp && step + 1 >= a.ctl->n_forced) lm_candidates(a, t, step, sm);
}
