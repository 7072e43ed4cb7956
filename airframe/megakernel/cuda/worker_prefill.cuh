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

// token b's xs and red
__device__ __forceinline__ float* xs_of(float* xs, uint32_t b) { return xs + b * AF_XS_FLOATS; }
__device__ __forceinline__ float* red_of(float* red, uint32_t b) { return red + 64 * b; }

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

// gate and up rows for all the block's tokens, then ffn_down token by token.
__device__ __noinline__ void pf_ffn(const af_args& a, const af_task& t, float* xs, float* red, float* sm, bool xs_ready) {
    const af_plan_consts& c = a.c;
    const uint32_t n = t.row_count, rows = a.ffn_max_rows;
    float* h = sm;                           // (AF_BLOCK, rows): gate, then silu(gate) * up
    float* up = h + AF_BLOCK * rows;         // (AF_BLOCK, rows)
    float* part = up + AF_BLOCK * rows;      // (groups, n_embd)
    if (!xs_ready)
        for (uint32_t b = 0; b < AF_BLOCK; ++b)
            rmsnorm_shared<true>(xs_of(xs, b), ffn_in(a, t.layer, b), f32_at(a, t.norm), c.n_embd, c.rms_eps, red_of(red, b));
    gemv_block<AF_PF_UNROLL, AF_BLOCK>(rows_of(a, t), xs, [&](uint32_t i, uint32_t b, float v) {
        if (i < n) h[b * rows + i] = v;
        else up[b * rows + i - n] = v;
    });
    for (uint32_t b = 0; b < AF_BLOCK; ++b) ffn_down(a, t, b, h + b * rows, up + b * rows, part, red_of(red, b));
}
