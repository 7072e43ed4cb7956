// worker.cu: the persistent megakernel worker. One block per SM runs its tasks of the plan
// wave by wave, with a grid barrier after every wave, for up to AF_MAX_STEPS tokens per
// cooperative launch. It makes no scheduling decision: the plan (tasks.bin, sorted by wave and
// worker) says what each block does. Layout and opcodes come from plan_format.h, which
// airframe/megakernel/plan/opcodes.py generates.
//
// Reduction orders are fixed, so every launch gives the same bits:
//  - weight dot products follow the numpy VM exactly (lane l of a warp owns the 8-element
//    vectors j with j % 32 == l, multiply and add rounded separately, lanes folded in halves);
//  - RMSNorm, RoPE, embedding and residual adds also follow the VM exactly;
//  - attention sums, the FFN down projection and the FFN reduce use fixed trees of their own
//    (documented beside each), and exp is CUDA's expf: these are where we differ from the VM.
//
// This file: the task loops (the block's task table, run_task, the greedy step; a prefill block's
// run_block_task) and the kernels the host launches; worker_base.cuh, worker_ops.cuh and
// worker_prefill.cuh hold the rest.
#include "worker_prefill.cuh"

// ---- the worker ---------------------------------------------------------------------------
// A task whose `pad` is set in the block's table (load_table) finds its input already in xs.
__device__ void run_task(const af_args& a, const af_task& t, uint32_t step, uint32_t pos, uint32_t token,
                         float* xs, float* red, float* sm) {
    const bool xs_ready = t.pad != 0;
    switch (t.opcode) {
        case AF_OP_EMBED: op_embed(a, t, token); break;
        case AF_OP_QKV: op_qkv(a, t, xs, red, xs_ready); break;
        case AF_OP_ATTN: op_attn(a, t, pos, sm); break;
        case AF_OP_WO: op_wo(a, t, pos, xs, xs_ready); break;
        case AF_OP_FFN: op_ffn(a, t, xs, red, sm, xs_ready); break;
        case AF_OP_FINAL_NORM: op_final_norm(a, t, xs, red); break;
        case AF_OP_LM_HEAD: op_lm_head(a, t, step, xs, sm); break;
        default: break;
    }
    __syncthreads();  // the next task reuses shared memory
}

// Combine the candidate slots of the step just finished (warp 0; the rule, largest value and
// lowest id among ties, gives the same answer in any order), or in a launch that samples, draw
// from them once the prompt has run (draw_token): every block reads the same slots and reaches
// the same token and the same decision to stop. Block 0 records the step (and the drawing state).
__device__ bool finish_step(const af_args& a, uint32_t done, uint32_t& next_token, uint32_t* bcast, float* sm) {
    const af_plan_consts& c = a.c;
    af_control* ctl = a.ctl;
    // a step after the prompt's last token draws its token when the launch samples
    const bool drawn = a.samp && done + 1 >= ctl->n_forced;
    const uint32_t drawn_id = drawn ? draw_token(a, done, sm) : 0u;
    if (threadIdx.x < 32) {
        const uint32_t lane = threadIdx.x, none = 0xffffffffu;
        const float* cand = a.act + c.act_cand;
        float v = -INFINITY;
        uint32_t id = drawn ? drawn_id : none;
        for (uint32_t s = lane; s < (drawn ? 0u : c.lm_parts); s += 32) {
            const float sv = ld_act(cand + 2 * s);
            const uint32_t si = __float_as_uint(ld_act(cand + 2 * s + 1));
            if (id == none || sv > v || (sv == v && si < id)) {
                v = sv;
                id = si;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, off);
            const uint32_t oi = __shfl_xor_sync(0xffffffffu, id, off);
            if (oi != none && (id == none || ov > v || (ov == v && oi < id))) {
                v = ov;
                id = oi;
            }
        }
        if (lane == 0) {
            const uint32_t error = ld_relaxed(&ctl->error);
            bool eos = false;
            for (uint32_t i = 0; i < ctl->n_eos && i < AF_MAX_EOS; ++i) eos |= id == ctl->eos[i];
            eos &= done + 1 >= ctl->n_forced;  // prompt steps never stop the request
            if (blockIdx.x == 0) {
                if (drawn) advance_state(a, done, id);
                ctl->tokens_out[done] = id;
                ctl->steps_done = done + 1;
                if (error) ctl->error_step = done;
                if (eos) ctl->stopped = 1;
            }
            bcast[0] = id;
            bcast[1] = error != 0 || eos;
        }
    }
    __syncthreads();
    next_token = bcast[0];
    return bcast[1] != 0;
}

#define AF_SKIP_WAVE 0x80000000u

// This block's tasks, copied once per launch into shared memory: wave_first[w] is the local
// index of wave w's first task (n_waves + 1 entries), wave_global[w] its index in tasks.bin,
// with AF_SKIP_WAVE set on a wave no block runs (the FFN reduce waves: op_ffn's atomics make
// their sums; in a prefill step also the final norm and the LM head).
// Its parts are found from the arguments each time they are used rather than held in registers,
// which the GEMV loops need more.
struct af_table {
    const af_args& a;
    float* base;
    __device__ __forceinline__ uint32_t* wave_first() const { return reinterpret_cast<uint32_t*>(base); }
    __device__ __forceinline__ uint32_t* wave_global() const { return wave_first() + a.c.n_waves + 1; }
    __device__ __forceinline__ uint32_t global(uint32_t w) const { return wave_global()[w] & ~AF_SKIP_WAVE; }
    __device__ __forceinline__ bool skipped(uint32_t w) const { return (wave_global()[w] & AF_SKIP_WAVE) != 0; }
    __device__ __forceinline__ af_task* tasks() const {
        return reinterpret_cast<af_task*>(base + ((2 * a.c.n_waves + 1 + 3) / 4) * 4);
    }
};

template <bool Prefill = false>
__device__ af_table load_table(const af_args& a, float* base) {
    const uint32_t n_waves = a.c.n_waves, me = blockIdx.x;
    const af_table tb{a, base};
    for (uint32_t w = threadIdx.x; w < n_waves; w += AF_THREADS) {
        const uint32_t workers = grid_blocks();
        const uint32_t lo = __ldg(a.cells + w * workers + me), hi = __ldg(a.cells + w * workers + me + 1);
        tb.wave_first()[w + 1] = hi - lo;
        tb.wave_global()[w] = lo;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        af_sides = a.sides;  // (read through side_live, where used)
        tb.wave_first()[0] = 0;
        for (uint32_t w = 1; w <= n_waves; ++w) tb.wave_first()[w] += tb.wave_first()[w - 1];
    }
    __syncthreads();
    for (uint32_t w = threadIdx.x; w < n_waves; w += AF_THREADS) {
        for (uint32_t k = 0; k < tb.wave_first()[w + 1] - tb.wave_first()[w]; ++k) {
            const uint4* src = reinterpret_cast<const uint4*>(a.tasks + tb.wave_global()[w] + k);
            uint4* dst = reinterpret_cast<uint4*>(tb.tasks() + tb.wave_first()[w] + k);
#pragma unroll
            for (int q = 0; q < AF_TASK_BYTES / 16; ++q) dst[q] = __ldg(src + q);
        }
        // pad (0 in tasks.bin) marks a task that follows one of the same opcode and layer in
        // this wave: xs already holds its input (the normed x or h + h_side, the merged
        // attention), so a worker's split-K pieces and shared FFN rows norm or merge once
        for (uint32_t k = tb.wave_first()[w] + 1; k < tb.wave_first()[w + 1]; ++k) {
            af_task& t = tb.tasks()[k];
            const af_task& before = tb.tasks()[k - 1];
            const bool fed = t.opcode == AF_OP_QKV || t.opcode == AF_OP_WO || t.opcode == AF_OP_FFN;
            t.pad = fed && before.opcode == t.opcode && before.layer == t.layer ? 1u : 0u;
        }
        const uint32_t workers = grid_blocks();
        const uint32_t first = __ldg(a.cells + w * workers), end = __ldg(a.cells + (w + 1) * workers);
        const uint32_t op = first < end ? __ldg(&a.tasks[first].opcode) : AF_OP_NOP;
        if (op == AF_OP_FFN_REDUCE || (Prefill && (op == AF_OP_FINAL_NORM || op == AF_OP_LM_HEAD)))
            tb.wave_global()[w] |= AF_SKIP_WAVE;
    }
    __syncthreads();
    return tb;
}

// af_span for the step at pos (a call: inlined into the token loop, it left NVRTC's sm_90 build 4 B
// of spills)
__device__ __noinline__ void set_span(const af_args& a, uint32_t pos) { af_span_shared = attn_span(a.c, pos); }

// A skipped wave in a traced step: its tasks and its release stamped now, taking no time.
__device__ void skip_trace(const af_args& a, const af_table& tb, uint32_t w) {
    const unsigned long long now = global_ns();
    for (uint32_t i = tb.wave_first()[w]; i < tb.wave_first()[w + 1]; ++i) {
        const uint32_t g = tb.global(w) + i - tb.wave_first()[w];
        a.trace[2 * g] = now;
        a.trace[2 * g + 1] = now;
    }
    if (a.trace_waves) a.trace_waves[w * grid_blocks() + blockIdx.x] = now;
}

extern "C" __global__ void __launch_bounds__(AF_THREADS, 1) af_worker(__grid_constant__ const af_args a) {
    extern __shared__ float4 smem4[];
    __shared__ uint32_t bcast[2];
    float* xs = reinterpret_cast<float*>(smem4);
    const af_plan_consts& c = a.c;
    float* red = xs + AF_RED_OFFSET;  // xs: two planes (AF_XS_PLANE_FLOATS)
    float* sm = xs + AF_SM_OFFSET;
    const af_table tb = load_table(a, xs + a.table_offset);
    af_control* ctl = a.ctl;
    // the step count lives in shared memory (read once a step), not in a register for the whole launch
    __shared__ uint32_t n_steps_shared;
    if (threadIdx.x == 0) n_steps_shared = min(ctl->n_steps, (uint32_t)AF_MAX_STEPS);
    __syncthreads();
    const volatile uint32_t& n_steps = n_steps_shared;
    const uint32_t me = blockIdx.x;
    uint32_t target = 0, token = 0;
#if AF_Q8
    // The step's token in shared memory, read where the embedding runs: held in a register through
    // every wave of the step and from one step to the next, it was what NVRTC's sm_86 Q8 build spilled.
    __shared__ uint32_t token_shared;
#endif
    for (uint32_t step = 0; step < n_steps; ++step) {
#if AF_Q8
        uint32_t token = 0;  // (this step's: finish_step sets it past step 0)
#endif
        if (step > 0 && finish_step(a, step - 1, token, bcast, sm)) return;
        if (step < ctl->n_forced) token = ctl->tokens_in[step];
#if AF_Q8
        token_shared = token;  // (every thread stores the same value)
#endif
        const uint32_t pos = ctl->pos0 + (ctl->hold_pos ? 0u : step);
        // (read from the attention wave on: the waves before it end in block barriers)
        if (threadIdx.x == 0) set_span(a, pos);
        const bool traced = a.trace && step == ctl->trace_step;
        for (uint32_t w = 0; w < c.n_waves; ++w) {
            if (tb.skipped(w)) {  // no work and no barrier
                if (traced && threadIdx.x == 0) skip_trace(a, tb, w);
                continue;
            }
            for (uint32_t i = tb.wave_first()[w]; i < tb.wave_first()[w + 1]; ++i) {
                const unsigned long long t0 = traced ? global_ns() : 0;
#if AF_Q8
                run_task(a, tb.tasks()[i], step, pos, *static_cast<volatile uint32_t*>(&token_shared), xs, red, sm);
#else
                run_task(a, tb.tasks()[i], step, pos, token, xs, red, sm);
#endif
                if (traced && threadIdx.x == 0) {
                    const uint32_t g = tb.global(w) + i - tb.wave_first()[w];
                    a.trace[2 * g] = t0;
                    const af_task& t = tb.tasks()[i];
                    const bool gemv = rows_of(a, t).n > 0;  // the task ran gemv_list
                    const bool marked = AF_TRACE_MARK == 1 ? gemv
                                        : AF_TRACE_MARK >= 7 ? t.opcode == AF_OP_FFN
                                                             : AF_TRACE_MARK > 1 && t.opcode == AF_OP_ATTN;
                    a.trace[2 * g + 1] = marked ? af_mark_ns : global_ns();
                }
            }
            grid_sync(a.barrier, target);
            if (traced && threadIdx.x == 0 && a.trace_waves) a.trace_waves[w * grid_blocks() + me] = global_ns();
        }
    }
    if (n_steps > 0) finish_step(a, n_steps - 1, token, bcast, sm);
}

// A task of a prefill step (worker_prefill.cuh): the AF_BLOCK tokens from position b0 on.
__device__ void run_block_task(const af_args& a, const af_task& t, uint32_t b0, const uint32_t* tokens, float* xs,
                               float* red, float* sm) {
    const bool xs_ready = t.pad != 0;
    switch (t.opcode) {
        case AF_OP_EMBED:
            for (uint32_t b = 0; b < AF_BLOCK; ++b) op_embed(a, t, tokens[b], b);
            break;
        case AF_OP_QKV: pf_qkv(a, t, xs, red, xs_ready); break;
        case AF_OP_ATTN: pf_attn(a, t, b0, sm); break;
        case AF_OP_WO: pf_wo(a, t, b0, xs, sm, xs_ready); break;
        case AF_OP_FFN: pf_ffn(a, t, xs, red, sm, xs_ready); break;
        default: break;  // the final norm and the LM head: their waves are skipped
    }
    __syncthreads();  // the next task reuses shared memory
}

// The prompt in prefill steps of AF_BLOCK tokens: step s runs tokens_in[s * AF_BLOCK ..] at
// positions pos0 + s * AF_BLOCK .. (n_steps * AF_BLOCK <= AF_MAX_STEPS tokens a launch), in the
// arenas of tokens 0 .. AF_BLOCK - 1; it makes no logits and no token. With a trace buffer, step
// trace_step is traced as a decode step is.
extern "C" __global__ void __launch_bounds__(AF_THREADS, 1) af_prefill(__grid_constant__ const af_args a) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);
    float* red = xs + AF_PF_RED_OFFSET;
    float* sm = xs + AF_PF_SM_OFFSET;
    const af_table tb = load_table<true>(a, xs + a.table_offset);
    af_control* ctl = a.ctl;
    const uint32_t n_steps = min(ctl->n_steps, (uint32_t)(AF_MAX_STEPS / AF_BLOCK));
    uint32_t target = 0;
    for (uint32_t step = 0; step < n_steps; ++step) {
        const uint32_t b0 = ctl->pos0 + step * AF_BLOCK;
        const bool traced = a.trace && step == ctl->trace_step;
        for (uint32_t w = 0; w < a.c.n_waves; ++w) {
            if (tb.skipped(w)) {
                if (traced && threadIdx.x == 0) skip_trace(a, tb, w);
                continue;
            }
            for (uint32_t i = tb.wave_first()[w]; i < tb.wave_first()[w + 1]; ++i) {
                const unsigned long long t0 = traced ? global_ns() : 0;
                run_block_task(a, tb.tasks()[i], b0, ctl->tokens_in + step * AF_BLOCK, xs, red, sm);
                if (traced && threadIdx.x == 0) {
                    const uint32_t g = tb.global(w) + i - tb.wave_first()[w];
                    a.trace[2 * g] = t0;
                    a.trace[2 * g + 1] = global_ns();
                }
            }
            grid_sync(a.barrier, target);
            if (traced && threadIdx.x == 0 && a.trace_waves) a.trace_waves[w * grid_blocks() + blockIdx.x] = global_ns();
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) ctl->steps_done = n_steps;
}

// The host checks its picture of af_args and af_control against the compiled one.
extern "C" __global__ void af_layout(uint32_t* out) {
    out[0] = sizeof(af_args);
    out[1] = sizeof(af_plan_consts);
    out[2] = offsetof(af_args, tasks);
    out[3] = offsetof(af_args, ffn_max_rows);
    out[4] = offsetof(af_plan_consts, rope_cos);
    out[5] = sizeof(af_control);
    out[6] = offsetof(af_control, steps_done);
    out[7] = AF_THREADS;
    out[8] = AF_FFN_COPIES;
    out[9] = sizeof(af_sampling);
    out[10] = offsetof(af_sampling, u);
    out[11] = AF_BLOCK;
}

// Streaming read for the bandwidth floor: every 16-byte word once, four loads in flight.
extern "C" __global__ void af_stream_read(const uint4* data, unsigned long long n16, uint32_t* sink) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    uint32_t x = 0;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = ld_weight16(data + i), b = ld_weight16(data + i + stride);
        const uint4 c = ld_weight16(data + i + 2 * stride), d = ld_weight16(data + i + 3 * stride);
        x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 a = ld_weight16(data + i);
        x ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (x == 0x9e3779b9u) sink[0] = x;  // never true in practice; keeps the loads alive
}
