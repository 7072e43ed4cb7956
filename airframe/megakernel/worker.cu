// worker.cu: the persistent megakernel worker. One block per SM runs its tasks of the plan
// wave by wave, with a grid barrier after every wave, for up to AF_MAX_STEPS tokens per
// cooperative launch. It makes no scheduling decision: the plan (tasks.bin, sorted by wave and
// worker) says what each block does. Layout and opcodes come from plan_format.h, which
// airframe/megakernel/opcodes.py generates.
//
// Reduction orders are fixed, so every launch gives the same bits:
//  - weight dot products follow the numpy VM exactly (lane l of a warp owns the 8-element
//    vectors j with j % 32 == l, multiply and add rounded separately, lanes folded in halves);
//  - RMSNorm, RoPE, embedding and residual adds also follow the VM exactly;
//  - attention sums, the FFN down projection and the FFN reduce use fixed trees of their own
//    (documented beside each), and exp is CUDA's expf: these are where we differ from the VM.
#include "plan_format.h"
#ifdef __CUDACC_RTC__  // NVRTC (no nvcc on the machine) has no C library headers
#define offsetof(type, member) __builtin_offsetof(type, member)
#define INFINITY __int_as_float(0x7f800000)
#endif

#define AF_THREADS 1024
#define AF_WARPS (AF_THREADS / 32)
#define AF_MAX_STEPS 64
#define AF_MAX_EOS 8
#define AF_MAX_GROUP 8  // query heads per K/V head
#ifndef AF_UNROLL
// 16-byte weight vectors per lane per chunk of a GEMV row of the FFN and the LM head (a chunk is
// 32 * AF_UNROLL vectors of one row, one warp's unit of work). Every register counts: a
// 1024-thread block has 64 per thread, and whatever holds more weight data in flight spills in
// the hot loops (measured on the H200, ms/token at context 1: 2 -> 1.10, 4 -> 1.15, 8 -> 1.31).
#define AF_UNROLL 4
#endif
#ifndef AF_UNROLL_SHORT
// The same for the QKV and WO rows: those waves hold at most a row per warp, so the number of
// round trips to memory per row, not the bytes in flight, sets their time.
#define AF_UNROLL_SHORT 4
#endif
#ifndef AF_DOWN_UNROLL
// ffn_down rows each thread loads at once (16 bytes of each)
#define AF_DOWN_UNROLL 4
#endif
#ifndef AF_LEAN_NORM
// 1: RMSNorm's x (and side) and weights move as 16-byte vectors, a quad per thread held in
// registers across the sum, and the VM's sequential sum reads shared memory four vectors ahead.
#define AF_LEAN_NORM 1
#endif
#ifndef AF_LEAN_MERGE
// 1: with one active attention chunk the merge is o / l per element (the VM's sums reduce to it
// exactly), two elements per thread.
#define AF_LEAN_MERGE 1
#endif
#ifndef AF_WEIGHT_EVICT_FIRST
// 1: weight loads carry the L2 policy evict_first, so the weight stream (gigabytes a token,
// read once) does not push out of L2 what the chains read: activations, norm weights, RoPE
// tables, the K/V cache.
#define AF_WEIGHT_EVICT_FIRST 1
#endif
#ifndef AF_SIDE_SKIP
// 1: a plan without split-K pieces never writes the side vectors (qkv_side, h_side): their reads
// (zeros, from DRAM every time) are replaced by adding 0.0f, which gives the same bits.
#define AF_SIDE_SKIP 1
#endif
#ifndef AF_LEAN_REDUCE
// 1: the FFN reduce folds the 32 warps' sums of a row with one warp's shuffles (three block
// barriers for 32 rows instead of seven); the same additions in the same order.
#define AF_LEAN_REDUCE 1
#endif
#ifndef AF_TRACE_MARK
// Measurements only (the device check's --phases): 1 makes a GEMV task's end stamp in the trace
// the moment its prologue (the norm, the merge, the copy of x) is done instead of its end; 2, 3,
// 4, 5 make an attention task's end stamp the end of its RoPE, scores, softmax, weighted values,
// 6 the moment it begins its work (what starting a task costs).
#define AF_TRACE_MARK 0
#endif
__shared__ unsigned long long af_mark_ns;  // AF_TRACE_MARK: the stamp the traced task ends with

// What the host sets before a launch and reads after it; all 32-bit words.
struct af_control {
    uint32_t n_steps;         // tokens to run in this launch (<= AF_MAX_STEPS)
    uint32_t pos0;            // position of the first one
    uint32_t n_forced;        // steps < n_forced take tokens_in[step]; later ones the greedy token
    uint32_t n_eos;           // end-of-generation ids in eos[]
    uint32_t eos[AF_MAX_EOS];
    uint32_t trace_step;      // the step whose tasks are timed when trace is set
    uint32_t reserved[3];
    uint32_t tokens_in[AF_MAX_STEPS];
    uint32_t steps_done;      // outputs from here on
    uint32_t error;           // bit 0: a non-finite logit
    uint32_t stopped;         // 1 when an end-of-generation token ended the launch
    uint32_t error_step;
    uint32_t tokens_out[AF_MAX_STEPS];  // greedy token after each step
};
static_assert(sizeof(af_control) == 4 * (16 + 2 * AF_MAX_STEPS + 4), "control layout");

struct af_args {
    af_plan_consts c;
    const af_task* tasks;
    const uint32_t* cells;          // task index of (wave, worker): cells[wave * workers + worker]
    const uint8_t* weights;
    float* act;
    float* kcache;                  // (layer, kv head, ctx, head_dim) F32
    float* vcache;                  // (layer, kv head, ctx, head_dim_v) F32
    af_control* ctl;
    uint32_t* barrier;              // arrivals, zero at launch
    float* logits_all;              // (n_steps, vocab) or null
    unsigned long long* trace;      // (n_tasks, 2) globaltimer ns or null
    unsigned long long* trace_waves;  // (n_waves, workers) barrier release ns or null
    uint32_t ffn_max_rows;
    uint32_t shared_floats;
    uint32_t table_offset;          // floats from the start of dynamic shared memory to the task table
    uint32_t table_tasks;           // the most tasks any block has (the table's size)
    uint32_t sides;                 // bit 0: the plan writes qkv_side (QKV split-K pieces); bit 1: h_side (WO)
};

// ---- memory access ------------------------------------------------------------------------
// Weights never change during a launch: read-only path, not kept in L1, and (AF_WEIGHT_EVICT_FIRST)
// the first to leave L2. The policy lives in a uniform register, not in the threads' registers.
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
    uint4 v;
    if (AF_WEIGHT_EVICT_FIRST) {
        uint64_t policy;
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
    } else {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    }
    return v;
}

// Activations and the K/V cache are written by other blocks in this launch: read them in L2.
__device__ __forceinline__ float ld_act(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float4 ld_act4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

// An element of a side vector (bit 0 of af_args.sides: qkv_side, bit 1: h_side). When the plan
// never writes it, it holds zeros and is not read: the consumer's x + 0.0f is the VM's x + side.
// (af_sides is a copy of af_args.sides in shared memory, read through volatile so that the
// compiler does not hold the answer in a register for the whole kernel.)
__shared__ uint32_t af_sides;
__device__ __forceinline__ bool side_live(uint32_t bit) {
    return !AF_SIDE_SKIP || (*static_cast<volatile uint32_t*>(&af_sides) & bit) != 0;
}
__device__ __forceinline__ float ld_side(const float* p, bool live) { return live ? ld_act(p) : 0.0f; }

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// AF_TRACE_MARK: the traced task's end stamp is taken here when `phase` is the one measured.
__device__ __forceinline__ void trace_mark(int phase) {
    if (AF_TRACE_MARK == phase && threadIdx.x == 0) af_mark_ns = global_ns();
}

// Grid barrier: a counter that only grows during a launch. Barrier number k (1, 2, ...) waits
// until k * blocks arrivals; the host zeroes the counter before each launch.
__device__ __forceinline__ uint32_t ld_relaxed(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void grid_sync(uint32_t* counter, uint32_t& target) {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        // The release is cumulative: it publishes this block's writes, which the __syncthreads
        // ordered before it. The acquire that sees the last arrival makes every block's writes
        // visible here, and the __syncthreads below passes that on to the block. (Fences around
        // relaxed operations, as before, cost ~0.3 us more per barrier on the H200.)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
        while (ld_acquire(counter) < target) {
        }
    }
    __syncthreads();
}

// a / b and a % b for the plan's shapes, whose divisors are nearly always powers of two: a shift
// or a mask instead of the ~20-instruction division, which every one of a block's 32 warps would
// otherwise pay at the start of a task (AF_FAST_DIV=0: plain division, for measurements).
#ifndef AF_FAST_DIV
#define AF_FAST_DIV 1
#endif
__device__ __forceinline__ uint32_t udiv(uint32_t a, uint32_t b) {
    return AF_FAST_DIV && (b & (b - 1)) == 0 ? a >> (__ffs(b) - 1) : a / b;
}
__device__ __forceinline__ uint32_t umod(uint32_t a, uint32_t b) {
    return AF_FAST_DIV && (b & (b - 1)) == 0 ? a & (b - 1) : a % b;
}

// ---- arithmetic in the VM's order ---------------------------------------------------------
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ float madd(float acc, float a, float b) {
    return __fadd_rn(acc, __fmul_rn(a, b));  // no FMA: the VM rounds the product
}

// acc += w . x over 8 consecutive elements, in element order; x is 8 floats in shared memory.
__device__ __forceinline__ float dot8(uint4 w, const float* x, float acc) {
    const float4 a = *reinterpret_cast<const float4*>(x);
    const float4 b = *reinterpret_cast<const float4*>(x + 4);
    acc = madd(acc, bf16_lo(w.x), a.x);
    acc = madd(acc, bf16_hi(w.x), a.y);
    acc = madd(acc, bf16_lo(w.y), a.z);
    acc = madd(acc, bf16_hi(w.y), a.w);
    acc = madd(acc, bf16_lo(w.z), b.x);
    acc = madd(acc, bf16_hi(w.z), b.y);
    acc = madd(acc, bf16_lo(w.w), b.z);
    acc = madd(acc, bf16_hi(w.w), b.w);
    return acc;
}

// Fold 32 lane values in halves (l + 16, + 8, + 4, + 2, + 1); every lane gets the total.
__device__ __forceinline__ float warp_fold(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// A list of BF16 rows: row i starts at p0 + i * stride for i < n0, at p1 + (i - n0) * stride
// after (FFN: the gate rows, then the up rows); kvec 8-element vectors of each are multiplied.
struct af_rows {
    const uint4* p0;
    const uint4* p1;
    uint32_t n0, n, stride, kvec;
    __device__ __forceinline__ const uint4* row(uint32_t i) const {
        return i < n0 ? p0 + (size_t)i * stride : p1 + (size_t)(i - n0) * stride;
    }
};

// Rows 0..n-1 of the list . xs, one warp per row, in the VM's lane order: lane l owns the
// vectors j with j % 32 == l; U vectors per lane per chunk are loaded, then multiplied.
// `prologue()` fills xs (a norm, a merge) and ends with __syncthreads; `emit(i, value)` runs on
// lane 0. (Requesting the first chunk before or during the prologue, to hide its latency behind
// it, measured slower every way it was tried: in registers, through cp.async, before or after
// the prologue's own loads. The prologue's reads of L2 come back later with weights in flight.)
template <int U, class Prologue, class Emit>
__device__ __forceinline__ void gemv_list(const af_rows& r, const float* xs, Prologue prologue, Emit emit) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t kvec = r.kvec;
    uint4 v[U];
    auto load = [&](const uint4* w, uint32_t base) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t j = base + u * 32 + lane;
            v[u] = j < kvec ? ld_weight16(w + j) : make_uint4(0, 0, 0, 0);
        }
    };
    prologue();
    trace_mark(1);
    for (uint32_t i = warp; i < r.n; i += AF_WARPS) {
        const uint4* w = r.row(i);
        float acc = 0.0f;
        for (uint32_t base = 0; base < kvec; base += 32 * U) {
            load(w, base);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t j = base + u * 32 + lane;
                if (j < kvec) acc = dot8(v[u], xs + 8 * j, acc);
            }
        }
        acc = warp_fold(acc);
        if (lane == 0) emit(i, acc);
    }
}

// Copy n floats of the arena into shared memory; with `side`, src + side element-wise (one rounding).
__device__ __forceinline__ void load_shared(float* dst, const float* src, uint32_t n, const float* side = nullptr) {
    for (uint32_t i = threadIdx.x; i < n; i += AF_THREADS)
        dst[i] = side ? __fadd_rn(ld_act(src + i), ld_act(side + i)) : ld_act(src + i);
}

// Warp 0: red[0] = 1 / sqrt(dot(x, x) / n + eps) of the n floats at xs (shared memory, n a
// multiple of 8) in the VM's order: lane l sums vectors l, l + 32, ... in turn (read four
// vectors ahead), the lanes folded in halves.
__device__ __forceinline__ void norm_inverse(const float* xs, uint32_t n, float eps, float* red) {
    const uint32_t lane = threadIdx.x, kvec = n / 8;  // called by threads 0-31
    float acc = 0.0f;
#pragma unroll 4
    for (uint32_t j = lane; j < kvec; j += 32) {
        const float4 a = reinterpret_cast<const float4*>(xs)[2 * j];
        const float4 b = reinterpret_cast<const float4*>(xs)[2 * j + 1];
        acc = madd(acc, a.x, a.x);
        acc = madd(acc, a.y, a.y);
        acc = madd(acc, a.z, a.z);
        acc = madd(acc, a.w, a.w);
        acc = madd(acc, b.x, b.x);
        acc = madd(acc, b.y, b.y);
        acc = madd(acc, b.z, b.z);
        acc = madd(acc, b.w, b.w);
    }
    acc = warp_fold(acc);
    if (lane == 0) {
        const float mean = __fdiv_rn(acc, (float)n);
        red[0] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    }
}

// xs = rmsnorm(x) over n elements, exactly as the VM: inv = 1 / sqrt(dot(x, x) / n + eps),
// y = (x * inv) * w; x is x + side when `side` is given (side_is_zero: a side vector no task
// writes, added as 0.0f). `red` is shared scratch of one float.
__device__ void rmsnorm_shared(float* xs, const float* x, const float* w, uint32_t n, float eps, float* red,
                               const float* side = nullptr, bool side_is_zero = false) {
    if (AF_LEAN_NORM && n % 8 == 0 && n <= 4 * AF_THREADS) {
        // quad q = threadIdx.x: x[4q, 4q + 4) (+ side) and its weights, kept in registers
        const uint32_t q = threadIdx.x;
        const bool mine = q < n / 4;
        float4 xv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), wv = xv;
        if (mine) {
            wv = __ldg(reinterpret_cast<const float4*>(w) + q);
            xv = __ldcg(reinterpret_cast<const float4*>(x) + q);
            if (side) {
                const float4 sv = side_is_zero ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                                               : __ldcg(reinterpret_cast<const float4*>(side) + q);
                xv = make_float4(__fadd_rn(xv.x, sv.x), __fadd_rn(xv.y, sv.y), __fadd_rn(xv.z, sv.z),
                                 __fadd_rn(xv.w, sv.w));
            }
            reinterpret_cast<float4*>(xs)[q] = xv;
        }
        __syncthreads();
        if (threadIdx.x < 32) norm_inverse(xs, n, eps, red);
        __syncthreads();
        const float inv = red[0];
        if (mine)
            reinterpret_cast<float4*>(xs)[q] = make_float4(
                __fmul_rn(__fmul_rn(xv.x, inv), wv.x), __fmul_rn(__fmul_rn(xv.y, inv), wv.y),
                __fmul_rn(__fmul_rn(xv.z, inv), wv.z), __fmul_rn(__fmul_rn(xv.w, inv), wv.w));
        __syncthreads();
        return;
    }
    // the norm weights of this thread's first two elements load with x, not after the sum
    const float w0 = threadIdx.x < n ? __ldg(w + threadIdx.x) : 0.0f;
    const float w1 = threadIdx.x + AF_THREADS < n ? __ldg(w + threadIdx.x + AF_THREADS) : 0.0f;
    load_shared(xs, x, n, side);
    __syncthreads();
    if (threadIdx.x < 32) norm_inverse(xs, n, eps, red);
    __syncthreads();
    const float inv = red[0];
    for (uint32_t i = threadIdx.x; i < n; i += AF_THREADS) {
        const float wi = i == threadIdx.x ? w0 : i == threadIdx.x + AF_THREADS ? w1 : __ldg(w + i);
        xs[i] = __fmul_rn(__fmul_rn(xs[i], inv), wi);
    }
    __syncthreads();
}

__device__ __forceinline__ const float* f32_at(const af_args& a, uint64_t offset) {
    return reinterpret_cast<const float*>(a.weights + offset);
}

// x[l]: the residual stream entering layer l (x[n_layers] leaves the last layer).
__device__ __forceinline__ float* x_at(const af_args& a, uint32_t l) {
    return a.act + a.c.act_x + (size_t)l * a.c.act_x_stride;
}

// Layer l's block of the arena; add lay_qkv, lay_attn, lay_h or lay_ffn.
__device__ __forceinline__ float* layer_at(const af_args& a, uint32_t l, uint32_t region) {
    return a.act + a.c.act_layer + (size_t)l * a.c.act_layer_size + region;
}

// ---- opcodes ------------------------------------------------------------------------------
__device__ void op_embed(const af_args& a, const af_task& t, uint32_t token) {
    const af_plan_consts& c = a.c;
    const uint16_t* row = reinterpret_cast<const uint16_t*>(a.weights + t.weight0) + (size_t)token * c.n_embd;
    float* out = x_at(a, 0);
    for (uint32_t r = t.row_start + threadIdx.x; r < t.row_start + t.row_count; r += AF_THREADS) {
        const float v = __uint_as_float((uint32_t)__ldg(row + r) << 16);
        out[r] = c.embed_scale == 1.0f ? v : __fmul_rn(v, c.embed_scale);
    }
}

// The weight rows a task multiplies, as gemv_list walks them (rows_of(t).n == 0: none). QKV and
// WO: rows [row_start, +row_count) of the matrix, columns [part_start, +part_count) of each (a
// split-K piece, or the whole row), lane 0 taking the piece's first 8 columns as the VM; FFN: the
// task's gate rows, then its up rows; LM_HEAD: its rows of the output matrix.
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

// qkv[rows] (side: qkv_side[rows]) = the task's piece of W_qkv . rmsnorm(x[layer]). The V row at
// pos goes to the cache in the attention wave (chunk 0), from qkv + qkv_side.
__device__ void op_qkv(const af_args& a, const af_task& t, float* xs, float* red, bool xs_ready) {
    const af_plan_consts& c = a.c;
    float* out = layer_at(a, t.layer, t.side ? c.lay_qkv_side : c.lay_qkv);
    auto norm = [&] {
        if (!xs_ready) rmsnorm_shared(xs, x_at(a, t.layer), f32_at(a, t.norm), c.n_embd, c.rms_eps, red);
    };
    gemv_list<AF_UNROLL_SHORT>(rows_of(a, t), xs + t.part_start, norm,
                               [&](uint32_t i, float v) { out[t.row_start + i] = v; });
}

// RoPE of one head (hd floats at src + side) into dst, with the package's tables at `pos`.
__device__ void rope_head(float* dst, const float* src, const float* side, const af_args& a, uint32_t pos,
                          uint32_t first_thread) {
    const af_plan_consts& c = a.c;
    const uint32_t half = c.rope_dim / 2, i = threadIdx.x - first_thread;
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

// One K/V head, one chunk of positions, g query heads: the flash-decoding partial (m, l, o).
// q, k and v at pos come from qkv + qkv_side; chunk 0 writes K and V at pos to the caches, and
// every chunk takes them from shared memory, never from the cache (chunk 0 may be writing it).
// Scores: head_dim/8 lanes per position, each an 8-element run, folded as the VM folds.
// l: lane-strided partials over positions, folded in halves. o: 1024/hdv position groups
// (position p in group p % groups), each in increasing p, then summed in group order.
__device__ void op_attn(const af_args& a, const af_task& t, uint32_t pos, float* sm) {
    const af_plan_consts& c = a.c;
    if (t.row_start > pos) {  // chunk not active yet
        if (AF_TRACE_MARK > 1) trace_mark(AF_TRACE_MARK);  // every phase ends here
        return;
    }
    trace_mark(6);
    const uint32_t hd = c.head_dim, hdv = c.head_dim_v, g = udiv(c.n_head, c.n_head_kv);
    const uint32_t first = t.row_start, n = min(t.row_count, pos + 1 - first);
    const float* qkv = layer_at(a, t.layer, c.lay_qkv);
    const float* side = layer_at(a, t.layer, c.lay_qkv_side);
    float* q = sm;                       // (g, hd), roped
    float* knew = q + g * hd;            // (hd), roped
    float* vnew = knew + hd;             // (hdv)
    float* s = vnew + hdv;               // (g, attn_chunk) scores, then exp
    const uint32_t groups = udiv(AF_THREADS, hdv);
    float* opart = s + g * c.attn_chunk;  // (groups, g, hdv)
    float* lsum = opart + groups * g * hdv;  // (g)
    float* mmax = lsum + g;                  // (g)
    const uint32_t lh = t.layer * c.n_head_kv + t.head;
    const uint32_t t_id = threadIdx.x;
    float* kbase = a.kcache + (size_t)lh * c.ctx * hd;
    const float* vbase = a.vcache + (size_t)lh * c.ctx * hdv;
    // scores: lanes per position = hd / 8 (a power of two <= 32); values: thread (group, d)
    const uint32_t lpp = hd / 8, per_warp = udiv(32, lpp);
    const uint32_t lane = t_id % 32, warp = t_id / 32, sub = udiv(lane, lpp), vl = umod(lane, lpp);
    const uint32_t d = umod(t_id, hdv), grp = udiv(t_id, hdv);
    // The position pos, when this chunk holds it, is its last (n - 1) and comes from knew and
    // vnew, never from the cache.
    const uint32_t cached = first + n - 1 == pos ? n - 1 : n;
    // thread j * hd + i ropes element i of query head j, the next hd threads the new key, the
    // next hdv copy the new value (q heads of this K/V head are rows (head * g + j) * hd, in turn)
    const uint32_t k_row = c.n_head * hd + t.head * hd, v_row = (c.n_head + c.n_head_kv) * hd + t.head * hdv;
    if (t_id < g * hd) {
        const uint32_t at = t_id - umod(t_id, hd), row = t.head * g * hd + at;
        rope_head(q + at, qkv + row, side + row, a, pos, at);
    } else if (t_id < (g + 1) * hd) {
        rope_head(knew, qkv + k_row, side + k_row, a, pos, g * hd);
    } else if (t_id < (g + 1) * hd + hdv) {
        const uint32_t d = t_id - (g + 1) * hd;
        vnew[d] = __fadd_rn(ld_act(qkv + v_row + d), ld_side(side + v_row + d, side_live(1)));
    }
    __syncthreads();
    trace_mark(2);
    float* vrow = a.vcache + ((size_t)lh * c.ctx + pos) * hdv;
    if (t.slot == 0 && t_id < hd) kbase[(size_t)pos * hd + t_id] = knew[t_id];
    if (t.slot == 0 && t_id >= hd && t_id < hd + hdv) vrow[t_id - hd] = vnew[t_id - hd];

    for (uint32_t p0 = warp * per_warp; p0 < n; p0 += AF_WARPS * per_warp) {
        const uint32_t p = p0 + sub;
        const bool live = p < n;
        const uint32_t abs_p = first + (live ? p : 0);
        float k8[8];
        if (abs_p == pos) {
#pragma unroll
            for (int e = 0; e < 8; ++e) k8[e] = knew[vl * 8 + e];
        } else {
            const float4 k0 = ld_act4(kbase + (size_t)abs_p * hd + vl * 8);
            const float4 k1 = ld_act4(kbase + (size_t)abs_p * hd + vl * 8 + 4);
            k8[0] = k0.x; k8[1] = k0.y; k8[2] = k0.z; k8[3] = k0.w;
            k8[4] = k1.x; k8[5] = k1.y; k8[6] = k1.z; k8[7] = k1.w;
        }
        for (uint32_t j = 0; j < g; ++j) {
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
    // weighted values; pos, the largest position of its group, is added after the cached ones
    if (grp < groups) {
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
        if (cached < n && umod(n - 1, groups) == grp) {
#pragma unroll
            for (int j = 0; j < AF_MAX_GROUP; ++j)
                if (j < (int)g) acc[j] = madd(acc[j], s[j * c.attn_chunk + n - 1], vnew[d]);
        }
#pragma unroll
        for (int j = 0; j < AF_MAX_GROUP; ++j)
            if (j < (int)g) opart[(grp * g + j) * hdv + d] = acc[j];
    }
    __syncthreads();
    trace_mark(5);
    const uint32_t rec = hdv + 2;
    float* out = layer_at(a, t.layer, c.lay_attn) + (size_t)(t.slot * c.n_head + t.head * g) * rec;
    for (uint32_t i = t_id; i < g * hdv; i += AF_THREADS) {
        const uint32_t j = udiv(i, hdv), dd = umod(i, hdv);
        float o = 0.0f;
        for (uint32_t k = 0; k < groups; ++k) o = __fadd_rn(o, opart[(k * g + j) * hdv + dd]);
        out[j * rec + 2 + dd] = o;
    }
    if (t_id < g) {
        out[t_id * rec] = mmax[t_id];
        out[t_id * rec + 1] = lsum[t_id];
    }
}

// The merge when one attention chunk is active (positions below attn_chunk): that chunk's max is
// m, so its scale is expf(0) = 1 and merge_attention's sums give total = l, o = 0 + o; xs =
// (0 + o) / l, the same bits, two elements per thread (records are 8-byte aligned: hdv is even).
__device__ __forceinline__ void merge_one_chunk(const af_args& a, uint32_t layer, float* xs) {
    const af_plan_consts& c = a.c;
    const uint32_t hdv = c.head_dim_v, rec = hdv + 2;
    const float* parts = layer_at(a, layer, c.lay_attn);
    for (uint32_t i = 2 * threadIdx.x; i < c.n_head * hdv; i += 2 * AF_THREADS) {
        const uint32_t h = udiv(i, hdv), d = umod(i, hdv);
        const float* r = parts + (size_t)h * rec;
        const float l = ld_act(r + 1);
        const float2 o = __ldcg(reinterpret_cast<const float2*>(r + 2 + d));
        *reinterpret_cast<float2*>(xs + i) = make_float2(__fdiv_rn(__fadd_rn(0.0f, o.x), l),
                                                         __fdiv_rn(__fadd_rn(0.0f, o.y), l));
    }
    __syncthreads();
}

// Merge the active chunks' partials for every query head into xs (n_head * hdv), as the VM.
// Not inlined: inside op_wo its loops left the worker 120-150 B of register spills at 64
// registers per thread (ptxas -v); as a call, the worker and it spill nothing.
__device__ __noinline__ void merge_attention(const af_args& a, uint32_t layer, uint32_t pos, float* xs) {
    const af_plan_consts& c = a.c;
    const uint32_t hdv = c.head_dim_v, rec = hdv + 2, active = pos / c.attn_chunk + 1;
    const float* parts = layer_at(a, layer, c.lay_attn);
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
        xs[i] = __fdiv_rn(o, total);
    }
    __syncthreads();
}

// h[rows] = x[layer][rows] + the task's piece of W_o . merged attention; a side piece goes to
// h_side[rows] with no residual.
__device__ void op_wo(const af_args& a, const af_task& t, uint32_t pos, float* xs, bool xs_ready) {
    const af_plan_consts& c = a.c;
    const float* x = x_at(a, t.layer);
    float* h = layer_at(a, t.layer, t.side ? c.lay_h_side : c.lay_h);
    auto merge = [&] {
        if (xs_ready) return;
        if (AF_LEAN_MERGE && pos < c.attn_chunk && c.head_dim_v % 2 == 0) merge_one_chunk(a, t.layer, xs);
        else merge_attention(a, t.layer, pos, xs);
    };
    gemv_list<AF_UNROLL_SHORT>(rows_of(a, t), xs + t.part_start, merge,
              [&](uint32_t i, float v) {
                  const uint32_t r = t.row_start + i;
                  h[r] = t.side ? v : __fadd_rn(ld_act(x + r), v);
              });
}

// gate and up rows of rmsnorm(h + h_side), silu(gate) * up into h; then this task's columns of
// ffn_down (stored transposed, one row of n_embd per FFN row), output rows [part_start,
// +part_count) only, times h. The down sum: `groups` row groups (row i in group i % groups),
// each in increasing row order, then summed in group order.
__device__ void op_ffn(const af_args& a, const af_task& t, float* xs, float* red, float* sm, bool xs_ready) {
    const af_plan_consts& c = a.c;
    const uint32_t e = c.n_embd, cols = e / 8;
    float* h = sm;                        // (row_count): gate, then silu(gate) * up
    float* up = sm + a.ffn_max_rows;      // (row_count)
    float* part = up + a.ffn_max_rows;    // (groups, n_embd)
    const uint32_t n = t.row_count;
    gemv_list<AF_UNROLL>(rows_of(a, t), xs,
              [&] {
                  if (!xs_ready)
                      rmsnorm_shared(xs, layer_at(a, t.layer, c.lay_h), f32_at(a, t.norm), e, c.rms_eps, red,
                                     layer_at(a, t.layer, c.lay_h_side), !side_live(2));
              },
              [&](uint32_t i, float v) {
                  if (i < n) h[i] = v;
                  else up[i - n] = v;
              });
    const uint32_t groups = cols >= AF_THREADS ? 1 : udiv(AF_THREADS, cols);
    const uint32_t grp = udiv(threadIdx.x, cols);
    const uint4* down = reinterpret_cast<const uint4*>(a.weights + t.weight2 + (size_t)t.row_start * e * 2);
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < n; i += AF_THREADS) {
        const float gate = h[i];
        h[i] = __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up[i]);
    }
    __syncthreads();
    const uint32_t col_lo = t.part_start / 8, col_hi = (t.part_start + t.part_count) / 8;
    if (grp < groups) {
        for (uint32_t col = umod(threadIdx.x, cols); col < cols; col += (cols >= AF_THREADS ? AF_THREADS : cols)) {
            if (col < col_lo || col >= col_hi) continue;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            uint32_t i = grp;
            for (; i + (AF_DOWN_UNROLL - 1) * groups < t.row_count; i += AF_DOWN_UNROLL * groups) {
                uint4 w[AF_DOWN_UNROLL];
#pragma unroll
                for (int u = 0; u < AF_DOWN_UNROLL; ++u) w[u] = ld_weight16(down + (size_t)(i + u * groups) * cols + col);
#pragma unroll
                for (int u = 0; u < AF_DOWN_UNROLL; ++u) {
                    const float hv = h[i + u * groups];
                    acc[0] = madd(acc[0], bf16_lo(w[u].x), hv);
                    acc[1] = madd(acc[1], bf16_hi(w[u].x), hv);
                    acc[2] = madd(acc[2], bf16_lo(w[u].y), hv);
                    acc[3] = madd(acc[3], bf16_hi(w[u].y), hv);
                    acc[4] = madd(acc[4], bf16_lo(w[u].z), hv);
                    acc[5] = madd(acc[5], bf16_hi(w[u].z), hv);
                    acc[6] = madd(acc[6], bf16_lo(w[u].w), hv);
                    acc[7] = madd(acc[7], bf16_hi(w[u].w), hv);
                }
            }
            for (; i < t.row_count; i += groups) {
                const uint4 w = ld_weight16(down + (size_t)i * cols + col);
                const float hv = h[i];
                acc[0] = madd(acc[0], bf16_lo(w.x), hv);
                acc[1] = madd(acc[1], bf16_hi(w.x), hv);
                acc[2] = madd(acc[2], bf16_lo(w.y), hv);
                acc[3] = madd(acc[3], bf16_hi(w.y), hv);
                acc[4] = madd(acc[4], bf16_lo(w.z), hv);
                acc[5] = madd(acc[5], bf16_hi(w.z), hv);
                acc[6] = madd(acc[6], bf16_lo(w.w), hv);
                acc[7] = madd(acc[7], bf16_hi(w.w), hv);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) part[grp * e + col * 8 + k] = acc[k];
        }
    }
    __syncthreads();
    float* out = layer_at(a, t.layer, c.lay_ffn) + (size_t)t.slot * e;
    for (uint32_t i = t.part_start + threadIdx.x; i < t.part_start + t.part_count; i += AF_THREADS) {
        float v = part[i];
        for (uint32_t k = 1; k < groups; ++k) v = __fadd_rn(v, part[k * e + i]);
        out[i] = v;
    }
}

// x[layer + 1][rows] = (h + h_side)[rows] + the FFN partials. The sum of a row is the VM's: lane
// l of a warp sums slots l, l + 32, ... in increasing order, and the 32 lane sums are folded in
// halves (l + 16, + 8, + 4, + 2, + 1). Here warp w plays lane w for 32 rows at once (one row per
// lane, so each load of a slot reads 32 consecutive floats), and the halving runs across warps
// in shared memory: the same additions in the same order.
__device__ void op_ffn_reduce(const af_args& a, const af_task& t, float* sm) {
    const af_plan_consts& c = a.c;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* parts = layer_at(a, t.layer, c.lay_ffn);
    const float* h = layer_at(a, t.layer, c.lay_h);
    const float* h_side = layer_at(a, t.layer, c.lay_h_side);
    float* x = x_at(a, t.layer + 1);
    static_assert(AF_WARPS == 32, "the halving below plays one warp's lanes with 32 warps");
    // (32 warps, 32 rows; AF_LEAN_REDUCE: rows padded to 33), then h + h_side of the 32 rows, then
    // (AF_LEAN_REDUCE) the 32 folded sums
    float* sums = sm;
    const uint32_t pitch = AF_LEAN_REDUCE ? 33 : 32;
    float* resid = sm + 32 * pitch;
    float* total = resid + 32;
    for (uint32_t base = 0; base < t.row_count; base += 32) {
        const uint32_t i = base + lane, r = t.row_start + i;
        const bool live = i < t.row_count;
        // the residual is requested with the partials (by the last warp, which has the fewest)
        if (warp == AF_WARPS - 1 && live)
            resid[lane] = __fadd_rn(ld_act(h + r), ld_side(h_side + r, side_live(2)));
        float acc = 0.0f;
        for (uint32_t k0 = warp; k0 < c.ffn_parts; k0 += AF_WARPS * 8) {  // 8 loads in flight: 256 slots at once
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const uint32_t k = k0 + AF_WARPS * u;
                v[u] = live && k < c.ffn_parts ? ld_act(parts + (size_t)k * c.n_embd + r) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (k0 + AF_WARPS * u < c.ffn_parts) acc = __fadd_rn(acc, v[u]);
        }
        sums[warp * pitch + lane] = acc;
        __syncthreads();
        if (AF_LEAN_REDUCE) {
            // warp w folds row base + w, lane l holding warp l's sum: warp_fold's xor halving
            // adds the same pairs in the same order as the halving across warps below
            const float v = warp_fold(sums[lane * pitch + warp]);
            if (lane == 0) total[warp] = v;
            __syncthreads();
            if (warp == 0 && live) x[r] = __fadd_rn(resid[lane], total[lane]);
        } else {
#pragma unroll
            for (uint32_t off = 16; off > 0; off >>= 1) {
                if (warp < off) sums[warp * 32 + lane] = __fadd_rn(sums[warp * 32 + lane], sums[(warp + off) * 32 + lane]);
                __syncthreads();
            }
            if (warp == 0 && live) x[r] = __fadd_rn(resid[lane], sums[lane]);
        }
        __syncthreads();
    }
}

__device__ void op_final_norm(const af_args& a, const af_task& t, float* xs, float* red) {
    const af_plan_consts& c = a.c;
    rmsnorm_shared(xs, x_at(a, c.n_layers), f32_at(a, t.norm), c.n_embd, c.rms_eps, red);
    for (uint32_t r = t.row_start + threadIdx.x; r < t.row_start + t.row_count; r += AF_THREADS)
        a.act[c.act_xn + r] = xs[r];
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
}

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
        case AF_OP_FFN_REDUCE: op_ffn_reduce(a, t, sm); break;
        case AF_OP_FINAL_NORM: op_final_norm(a, t, xs, red); break;
        case AF_OP_LM_HEAD: op_lm_head(a, t, step, xs, sm); break;
        default: break;
    }
    __syncthreads();  // the next task reuses shared memory
}

// Combine the candidate slots of the step just finished (warp 0; the rule, largest value and
// lowest id among ties, gives the same answer in any order): every block reads the same slots
// and reaches the same token and the same decision to stop. Block 0 records the step.
__device__ bool finish_step(const af_args& a, uint32_t done, uint32_t& next_token, uint32_t* bcast) {
    const af_plan_consts& c = a.c;
    af_control* ctl = a.ctl;
    if (threadIdx.x < 32) {
        const uint32_t lane = threadIdx.x, none = 0xffffffffu;
        const float* cand = a.act + c.act_cand;
        float v = -INFINITY;
        uint32_t id = none;
        for (uint32_t s = lane; s < c.lm_parts; s += 32) {
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

// This block's tasks, copied once per launch into shared memory: wave_first[w] is the local
// index of wave w's first task (n_waves + 1 entries), wave_global[w] its index in tasks.bin.
// Its parts are found from the arguments each time they are used rather than held in registers,
// which the GEMV loops need more.
struct af_table {
    const af_args& a;
    float* base;
    __device__ __forceinline__ uint32_t* wave_first() const { return reinterpret_cast<uint32_t*>(base); }
    __device__ __forceinline__ uint32_t* wave_global() const { return wave_first() + a.c.n_waves + 1; }
    __device__ __forceinline__ af_task* tasks() const {
        return reinterpret_cast<af_task*>(base + ((2 * a.c.n_waves + 1 + 3) / 4) * 4);
    }
};

__device__ af_table load_table(const af_args& a, float* base) {
    const uint32_t n_waves = a.c.n_waves, workers = gridDim.x, me = blockIdx.x;
    const af_table tb{a, base};
    for (uint32_t w = threadIdx.x; w < n_waves; w += AF_THREADS) {
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
    }
    __syncthreads();
    return tb;
}

extern "C" __global__ void __launch_bounds__(AF_THREADS, 1) af_worker(__grid_constant__ const af_args a) {
    extern __shared__ float4 smem4[];
    __shared__ uint32_t bcast[2];
    float* xs = reinterpret_cast<float*>(smem4);
    const af_plan_consts& c = a.c;
    const uint32_t x_len = max(c.n_embd, c.n_head * c.head_dim_v);
    float* red = xs + ((x_len + 3) / 4) * 4;
    float* sm = red + 64;
    const af_table tb = load_table(a, xs + a.table_offset);
    af_control* ctl = a.ctl;
    // the step count lives in shared memory (read once a step), not in a register for the whole launch
    __shared__ uint32_t n_steps_shared;
    if (threadIdx.x == 0) n_steps_shared = min(ctl->n_steps, (uint32_t)AF_MAX_STEPS);
    __syncthreads();
    const volatile uint32_t& n_steps = n_steps_shared;
    const uint32_t workers = gridDim.x, me = blockIdx.x;
    uint32_t target = 0, token = 0;
    for (uint32_t step = 0; step < n_steps; ++step) {
        if (step > 0 && finish_step(a, step - 1, token, bcast)) return;
        if (step < ctl->n_forced) token = ctl->tokens_in[step];
        const uint32_t pos = ctl->pos0 + step;
        const bool traced = a.trace && step == ctl->trace_step;
        for (uint32_t w = 0; w < c.n_waves; ++w) {
            for (uint32_t i = tb.wave_first()[w]; i < tb.wave_first()[w + 1]; ++i) {
                const unsigned long long t0 = traced ? global_ns() : 0;
                run_task(a, tb.tasks()[i], step, pos, token, xs, red, sm);
                if (traced && threadIdx.x == 0) {
                    const uint32_t g = tb.wave_global()[w] + i - tb.wave_first()[w];
                    a.trace[2 * g] = t0;
                    const af_task& t = tb.tasks()[i];
                    const bool gemv = rows_of(a, t).n > 0;  // the task ran gemv_list
                    const bool marked = AF_TRACE_MARK == 1 ? gemv : AF_TRACE_MARK > 1 && t.opcode == AF_OP_ATTN;
                    a.trace[2 * g + 1] = marked ? af_mark_ns : global_ns();
                }
            }
            grid_sync(a.barrier, target);
            if (traced && threadIdx.x == 0 && a.trace_waves) a.trace_waves[w * workers + me] = global_ns();
        }
    }
    if (n_steps > 0) finish_step(a, n_steps - 1, token, bcast);
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
