// worker_prefill.cuh: the opcodes of a prefill step (af_prefill in worker.cu). A prefill step runs
// the AF_BLOCK prompt tokens at positions b0 .. b0 + AF_BLOCK - 1 through the plan's waves at once:
// every weight vector a worker loads is multiplied with each token's input (gemv_block), so the
// block costs about one decode step's weight reads. Each token has its own arena (tok) and gets a
// decode step's arithmetic in a decode step's order, so the block leaves the bits of AF_BLOCK
// decode steps in the K/V cache; the final norm and the LM head do not run (the prompt's last
// token goes through a decode step, which makes its logits).
#pragma once
#include "worker_ops.cuh"

#define AF_BLOCK 8  // prompt tokens a prefill step runs (runtime.BLOCK)
// weight vectors per lane per chunk of a prefill GEMV: each is used AF_BLOCK times, and one a lane
// keeps the block's sums in registers (two spilled 24-60 B a call in the BF16 build, ptxas -v)
#define AF_PF_UNROLL 1
// Its dynamic shared memory: xs of each token (AF_XS_FLOATS apart), red of each (64 floats
// apart), then sm, the opcodes' scratch, up to the task table.
#define AF_PF_RED_OFFSET (AF_BLOCK * AF_XS_FLOATS)
#define AF_PF_SM_OFFSET (AF_PF_RED_OFFSET + AF_BLOCK * 64)

// tokens whose down sums a thread keeps (4 columns each) while one pass of pf_down reads its rows
#define AF_PF_DOWN_TOKENS 4
static_assert(AF_BLOCK % AF_PF_DOWN_TOKENS == 0 && AF_PF_DOWN_TOKENS == 4, "pf_down reads 4 tokens' h as a float4");

// A down row's bytes in pf_down, which the block's next pass reads again: kept in L2 (no evict_first).
__device__ __forceinline__ uint2 ld_again8(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t ld_again4(const void* p) {
    uint32_t v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// token b's xs and red
__device__ __forceinline__ float* xs_of(float* xs, uint32_t b) { return xs + b * AF_XS_FLOATS; }
__device__ __forceinline__ float* red_of(float* red, uint32_t b) { return red + 64 * b; }
__device__ __forceinline__ const float* red_of(const float* red, uint32_t b) { return red + 64 * b; }

// (The pf_ opcodes are calls, as merge_chunks: inlined into af_prefill they spilled 150-250 B of
// its 64 registers a thread; as calls, none.)
__device__ __noinline__ void pf_qkv(const af_args& a, const af_task& t, float* xs, float* red, bool xs_ready) {
    const af_plan_consts& c = a.c;
    if (!xs_ready)
        for (uint32_t b = 0; b < AF_BLOCK; ++b)
            rmsnorm_shared<true>(xs_of(xs, b), x_in(a, t.layer, b), f32_at(a, t.norm), c.n_embd, c.rms_eps, red_of(red, b));
    gemv_block<AF_PF_UNROLL, AF_BLOCK>(rows_of(a, t), xs + AF_XS_STEP * (t.part_start / 8), [&](uint32_t i, uint32_t b, float v) {
        float* out = layer_at(a, t.layer, t.side ? c.lay_qkv_side : c.lay_qkv, b);
        out[t.row_start + i] = __fmul_rn(v, norm_scale(red_of(red, b), c.n_embd, c.rms_eps));
    });
}

// The block's K rows (roped at their positions) and V rows of task t's K/V head go to shared memory
// and, from chunk 0, to the caches; then per token, its query heads roped and attn_chunk over the
// positions the chunk holds at the token's position (those of the block from shared memory).
__device__ __noinline__ void pf_attn(const af_args& a, const af_task& t, uint32_t b0, float* sm) {
    const af_plan_consts& c = a.c;
    const uint32_t hd = c.head_dim, hdv = c.head_dim_v, g = udiv(c.n_head, c.n_head_kv);
    const af_attn_room room(c, sm, AF_BLOCK);
    const uint32_t k_row = head_row(c, t, g, g), v_row = (c.n_head + c.n_head_kv) * hd + t.head * hdv;
    for (uint32_t e = threadIdx.x; e < AF_BLOCK * hd; e += AF_THREADS) {
        const uint32_t b = udiv(e, hd);
        const float* qkv = layer_at(a, t.layer, c.lay_qkv, b) + k_row;
        rope_head(room.kb + b * hd, qkv, layer_at(a, t.layer, c.lay_qkv_side, b) + k_row, a, b0 + b, e - b * hd);
    }
    for (uint32_t e = threadIdx.x; e < AF_BLOCK * hdv; e += AF_THREADS) {
        const uint32_t b = udiv(e, hdv), d = e - b * hdv;
        const float* qkv = layer_at(a, t.layer, c.lay_qkv, b) + v_row;
        const float* side = layer_at(a, t.layer, c.lay_qkv_side, b) + v_row;
        room.vb[e] = __fadd_rn(ld_act(qkv + d), ld_side(side + d, side_live(1)));
    }
    __syncthreads();
    if (t.slot == 0) {  // the one writer of these rows
        const size_t lh = t.layer * c.n_head_kv + t.head;
        for (uint32_t e = threadIdx.x; e < AF_BLOCK * hd; e += AF_THREADS) a.kcache[(lh * c.ctx + b0) * hd + e] = room.kb[e];
        for (uint32_t e = threadIdx.x; e < AF_BLOCK * hdv; e += AF_THREADS) a.vcache[(lh * c.ctx + b0) * hdv + e] = room.vb[e];
    }
    for (uint32_t b = 0; b < AF_BLOCK; ++b) {
        const uint32_t pos = b0 + b, span = attn_span(c, pos), first = t.slot * span;
        if (first > pos) continue;  // chunk not active at this position
        if (threadIdx.x < g * hd) {
            const uint32_t j = udiv(threadIdx.x, hd), row = head_row(c, t, j, g);
            rope_head(room.q + j * hd, layer_at(a, t.layer, c.lay_qkv, b) + row,
                      layer_at(a, t.layer, c.lay_qkv_side, b) + row, a, pos, threadIdx.x - j * hd);
        }
        __syncthreads();
        attn_chunk(a, t, b, pos, b0, first, min(span, pos + 1 - first), room.q, room.kb, room.vb, room.s);
        __syncthreads();  // q and the scores are the next token's
    }
}

// Each token's merged attention into its xs (the span of its position), then the WO rows for all.
__device__ __noinline__ void pf_wo(const af_args& a, const af_task& t, uint32_t b0, float* xs, float* sm, bool xs_ready) {
    const af_plan_consts& c = a.c;
    if (!xs_ready) {
        for (uint32_t b = 0; b < AF_BLOCK; ++b) {
            const uint32_t pos = b0 + b;
            if (threadIdx.x == 0) af_span_shared = attn_span(c, pos);
            __syncthreads();
            if (pos < af_span() && c.head_dim_v % 2 == 0) merge_one_chunk(a, t.layer, xs_of(xs, b), b);
            else merge_chunks(a, t.layer, pos, xs_of(xs, b), b, sm, a.table_offset - AF_PF_SM_OFFSET);
        }
    }
    gemv_block<AF_PF_UNROLL, AF_BLOCK>(rows_of(a, t), xs + AF_XS_STEP * (t.part_start / 8), [&](uint32_t i, uint32_t b, float v) {
        const uint32_t r = t.row_start + i;
        float* h = layer_at(a, t.layer, t.side ? c.lay_h_side : c.lay_h, b);
        h[r] = t.side ? v : __fadd_rn(x_in(a, t.layer, b).at(r, c.n_embd), v);
#pragma unroll
        for (int k = 0; k < AF_FFN_COPIES; ++k) ffn_acc(a, t.layer, b)[k * c.n_embd + r] = 0ull;
    });
}

// ffn_down (worker_ops.cuh) for the block's tokens, the same sums in the same orders, each down row
// read once per AF_PF_DOWN_TOKENS tokens, 4 columns a thread. h, up: (AF_BLOCK, rows) gate and up
// sums; hb: (rows, AF_BLOCK) silu(gate) * up. A quad's row groups sit in adjacent lanes (groups <=
// 32: n_embd >= 256, Runtime.prefill_layout) and are added in group order by shuffles.
__device__ __noinline__ void pf_down(const af_args& a, const af_task& t, const float* h, const float* up, float* hb,
                                     const float* red) {
    const af_plan_consts& c = a.c;
    const uint32_t e = c.n_embd, n = t.row_count, rows = a.ffn_max_rows;
    const uint32_t groups = e / 8 >= AF_THREADS ? 1 : udiv(AF_THREADS, e / 8);
    trace_mark(7);
    __syncthreads();
    for (uint32_t x = threadIdx.x; x < AF_BLOCK * n; x += AF_THREADS) {
        const uint32_t b = udiv(x, n), i = x - b * n;
        hb[i * AF_BLOCK + b] = silu_up(h[b * rows + i], up[b * rows + i], norm_scale(red_of(red, b), e, c.rms_eps));
    }
    __syncthreads();
    const uint32_t lane = threadIdx.x % 32, per_warp = 32 / groups;
    const uint32_t slot = udiv(lane, groups), grp = lane - slot * groups;
    const uint32_t q_lo = t.part_start / 4, q_hi = (t.part_start + t.part_count) / 4;
    bool bad = false;
    for (uint32_t q0 = q_lo; q0 < q_hi; q0 += AF_WARPS * per_warp) {  // the same count in every lane
        const uint32_t quad = q0 + threadIdx.x / 32 * per_warp + slot;
        const bool live = slot < per_warp && quad < q_hi;
#pragma unroll 1
        for (uint32_t b0 = 0; b0 < AF_BLOCK; b0 += AF_PF_DOWN_TOKENS) {
            float acc[AF_PF_DOWN_TOKENS][4] = {};
            auto add = [&](uint32_t i, uint2 w, const float* sc) {
                const float4 v = *reinterpret_cast<const float4*>(hb + i * AF_BLOCK + b0);
                const float vb[AF_PF_DOWN_TOKENS] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
#if AF_Q8
                    const float wk = q8_weight(sc[k], w, k);
#else
                    const float wk = k % 2 ? bf16_hi(k < 2 ? w.x : w.y) : bf16_lo(k < 2 ? w.x : w.y);
#endif
#pragma unroll
                    for (int b = 0; b < AF_PF_DOWN_TOKENS; ++b) acc[b][k] = madd(acc[b][k], wk, vb[b]);
                }
            };
            uint32_t i = live ? grp : n;
#if AF_Q8
            const uint8_t* down = a.weights + t.weight2;  // blocks of 32 rows (q8_down_block)
            while (i < n) {  // block by block, as ffn_down
                const uint32_t f = t.row_start + i;
                const uint8_t* block = down + q8_down_block(e, f);
                const uint2 raw = ld_again8(block + q8_down_scales(e, 0) + 8 * quad);
                const float sc[4] = {f16_float(raw.x), f16_float(raw.x >> 16), f16_float(raw.y), f16_float(raw.y >> 16)};
                const uint32_t end = min((f | 31u) + 1 - t.row_start, n);
#pragma unroll 1
                for (; i < end; i += groups)
                    add(i, make_uint2(ld_again4(block + q8_down_quants(e, t.row_start + i, 0) + 4 * quad), 0u), sc);
            }
#else
            const uint2* down = reinterpret_cast<const uint2*>(a.weights + t.weight2 + (size_t)t.row_start * e * 2) + quad;
            for (; i + groups < n; i += 2 * groups) {
                const uint2 w0 = ld_again8(down + (size_t)i * (e / 4)), w1 = ld_again8(down + (size_t)(i + groups) * (e / 4));
                add(i, w0, nullptr);
                add(i + groups, w1, nullptr);
            }
            if (i < n) add(i, ld_again8(down + (size_t)i * (e / 4)), nullptr);
#endif
            // group g's sums from lane grp g of the quad: added in group order into group 0's lane,
            // which turns them into the tokens' fixed-point atomics (ffn_down's last part)
#pragma unroll
            for (int b = 0; b < AF_PF_DOWN_TOKENS; ++b) {
                uint32_t tok = b0 + b;
                asm("" : "+r"(tok));  // computed here, not held through the rows loop
                unsigned long long* sums = ffn_acc(a, t.layer, tok) + (size_t)(blockIdx.x % AF_FFN_COPIES) * e + quad * 4;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float v = acc[b][k];
                    for (uint32_t d = 1; d < groups; ++d) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, acc[b][k], d));
                    if (live && grp == 0) fix_add(sums + k, v, bad);
                }
            }
        }
    }
    if (bad) atomicOr(&a.ctl->error, 2u);
    trace_mark(8);
}

// gate and up rows for all the block's tokens, then their down rows (pf_down).
__device__ __noinline__ void pf_ffn(const af_args& a, const af_task& t, float* xs, float* red, float* sm, bool xs_ready) {
    const af_plan_consts& c = a.c;
    const uint32_t n = t.row_count, rows = a.ffn_max_rows;
    float* h = sm;                           // (AF_BLOCK, rows): gate
    float* up = h + AF_BLOCK * rows;         // (AF_BLOCK, rows)
    if (!xs_ready)
        for (uint32_t b = 0; b < AF_BLOCK; ++b)
            rmsnorm_shared<true>(xs_of(xs, b), ffn_in(a, t.layer, b), f32_at(a, t.norm), c.n_embd, c.rms_eps, red_of(red, b));
    gemv_block<AF_PF_UNROLL, AF_BLOCK>(rows_of(a, t), xs, [&](uint32_t i, uint32_t b, float v) {
        if (i < n) h[b * rows + i] = v;
        else up[b * rows + i - n] = v;
    });
    pf_down(a, t, h, up, up + AF_BLOCK * rows, red);
}
