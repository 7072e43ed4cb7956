// worker_base.cuh: what every opcode of the megakernel worker (worker.cu) stands on: its
// constants, the launch structs the host mirrors (af_control, af_args), memory
// access, the grid barrier, the arithmetic in the VM's order, the GEMV over a row list and
// RMSNorm.
#pragma once
#include "plan_format.h"
#ifdef __CUDACC_RTC__  // NVRTC (no nvcc on the machine) has no C library headers
#define offsetof(type, member) __builtin_offsetof(type, member)
#define INFINITY __int_as_float(0x7f800000)
#endif

// Threads per worker block, one block per SM. The host reads it from af_layout and the planner's
// target carries it: the VM's attention and FFN-down orders depend on it.
#define AF_THREADS 1024
#define AF_WARPS (AF_THREADS / 32)
#define AF_MAX_STEPS 64
#define AF_MAX_EOS 8
#define AF_MAX_GROUP 8  // query heads per K/V head
// 16-byte weight vectors per lane per chunk of a GEMV row (a chunk is 32 * AF_UNROLL vectors of
// one row, one warp's unit of work; Q8: 8 bytes of quants and their 2-byte scale). A 1024-thread block has 64 registers per thread, and whatever
// holds more weight data in flight spills in the hot loops; a QKV or WO wave gives each warp at
// most one row, so there the number of round trips per row sets the time.
#define AF_UNROLL 4
#define AF_DOWN_UNROLL 4  // ffn_down rows each thread loads at once (16 bytes of each; Q8: 8)
// The FFN's 64-bit fixed-point sums (op_ffn) in this many copies, n_embd words apart: block b adds
// to copy b % AF_FFN_COPIES and the readers add the copies' integers (wrapping 64-bit adds: exact,
// so the same bits). L2 performs the atomics to one address one after another; two copies halve
// the 132 that queue on each accumulator of the H200 for a second 16 KiB read in every norm of x.
// The host reads the count from af_layout: the copies fill 2 x AF_FFN_COPIES FFN slots.
#define AF_FFN_COPIES 2
// The vector a GEMV multiplies (xs, shared memory) is kept as two planes: elements 8j..8j+3 of
// 8-element vector j at float 4j of plane 0, elements 8j+4..8j+7 at 4j of plane 1,
// AF_XS_PLANE_FLOATS floats further on. Lane l of a warp reads vectors l, l + 32, ...: 32
// consecutive 16-byte words per plane (in element order two lanes would share every bank).
// The plane offset is a constant so that no register holds it in the GEMV loops (a variable one
// spilled). It bounds the vectors xs holds to 4,096 floats (n_embd and n_head * head_dim_v;
// check_model_limits).
#define AF_XS_PLANE_FLOATS 2048
#define AF_XS_STEP 4  // floats from vector j to vector j + 1 in a plane
#define AF_XS_FLOATS (2 * AF_XS_PLANE_FLOATS)  // xs: both planes
// Dynamic shared memory from its start: xs (two planes), red (64 floats), then sm, the scratch the
// opcodes share, up to the task table (af_args.table_offset); runtime.shared_floats.
#define AF_RED_OFFSET (2 * AF_XS_PLANE_FLOATS)
#define AF_SM_OFFSET (AF_RED_OFFSET + 64)
#define AF_FIX_LIMIT 4194304.0f          // 2^22: |partial| below this, so 512 slots cannot overflow
#define AF_FIX_SCALE 4294967296.0f       // 2^32
#define AF_FIX_UNIT 2.3283064365386963e-10f  // 2^-32
#ifndef AF_TRACE_MARK
// The one diagnostic build setting (the device check's --phases; it changes what a trace records,
// never the results): 1 makes a GEMV task's end stamp in the trace the moment its prologue (the
// norm, the merge, the copy of x) is done instead of its end; 2, 3, 4, 5 make an attention task's
// end stamp the end of its RoPE, scores, softmax, weighted values, 6 the moment it begins its work
// (what starting a task costs); 7, 8, 9 an FFN task's the end of its gate and up rows, of its down
// rows, of its fixed-point sums' atomics.
#define AF_TRACE_MARK 0
#endif
#ifndef AF_Q8
// The weight format, a build setting: 0 (the shipped build) reads every matrix as BF16; 1 as Q8_0
// (int8 quants with an f16 scale per 32 weights, planner.WEIGHT_FORMATS; a package says which in
// weights_q8). Either way the weights widen exactly to f32 and every sum keeps the VM's order.
#define AF_Q8 0
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
    uint32_t hold_pos;        // 1: every step runs at pos0 (benchmarks: the cost at one context)
    uint32_t reserved[2];
    uint32_t tokens_in[AF_MAX_STEPS];
    uint32_t steps_done;      // outputs from here on
    uint32_t error;           // bit 0: a non-finite logit; bit 1: an FFN partial out of the fixed-point range
    uint32_t stopped;         // 1 when an end-of-generation token ended the launch
    uint32_t error_step;
    uint32_t tokens_out[AF_MAX_STEPS];  // greedy token after each step
};
static_assert(sizeof(af_control) == 4 * (16 + 2 * AF_MAX_STEPS + 4), "control layout");

struct af_sampling;  // worker_sample.cuh

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
    const af_sampling* samp;        // the drawn steps sample with these settings; null: greedy
    uint32_t ffn_max_rows;
    uint32_t shared_floats;
    uint32_t table_offset;          // floats from the start of dynamic shared memory to the task table
    uint32_t table_tasks;           // the most tasks any block has (the table's size)
    uint32_t sides;                 // bit 0: the plan writes qkv_side (QKV split-K pieces); bit 1: h_side (WO)
};

// ---- memory access ------------------------------------------------------------------------
// 16 bytes of activations (written in this launch: through L2, not L1) into shared memory without
// passing registers; cp_async_wait_all waits for this thread's copies.
__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(global) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Weights never change during a launch: read-only path, not kept in L1, and the first to leave
// L2 (evict_first), so that the weight stream, gigabytes a token read once, does not push out of
// L2 what the chains read: activations, norm weights, RoPE tables, the K/V cache. The policy
// lives in a uniform register, not in the threads' registers.
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
    uint4 v;
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
    return v;
}

#if AF_Q8
// 8 quants (one lane's vector of a Q8 row, or 8 columns of an ffn_down row), as ld_weight16.
__device__ __forceinline__ uint2 ld_weight8(const void* p) {
    uint2 v;
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
        : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(policy));
    return v;
}

// One f16 scale of a Q8 row, as ld_weight16 (the 4 lanes whose vectors share it read it at once).
__device__ __forceinline__ uint32_t ld_weight2(const void* p) {
    uint16_t v;
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(policy));
    return v;
}
#endif

// Activations and the K/V cache are written by other blocks in this launch: read them in L2.
__device__ __forceinline__ float ld_act(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float4 ld_act4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

// An element of a side vector (bit 0 of af_args.sides: qkv_side, bit 1: h_side). When the plan
// never writes it, it holds zeros and is not read: the consumer's x + 0.0f is the VM's x + side.
// (af_sides is a copy of af_args.sides in shared memory, read through volatile so that the
// compiler does not hold the answer in a register for the whole kernel.)
__shared__ uint32_t af_sides;
__device__ __forceinline__ bool side_live(uint32_t bit) {
    return (*static_cast<volatile uint32_t*>(&af_sides) & bit) != 0;
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

// gridDim.x, read where it is needed: held in a register across the waves, it was spilled.
__device__ __forceinline__ uint32_t grid_blocks() {
    uint32_t n;
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
    return n;
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
    target += grid_blocks();
    __syncthreads();
    if (threadIdx.x == 0) {
        // The release is cumulative: it publishes this block's writes, which the __syncthreads
        // ordered before it. The acquire that sees the last arrival makes every block's writes
        // visible here, and the __syncthreads below passes that on to the block. (Fences around
        // relaxed operations cost ~0.3 us more per barrier on the H200.)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
        while (ld_acquire(counter) < target) {
        }
    }
    __syncthreads();
}

// a / b and a % b for the plan's shapes, whose divisors are nearly always powers of two: a shift
// or a mask instead of the ~20-instruction division, which every one of a block's 32 warps would
// otherwise pay at the start of a task.
__host__ __device__ __forceinline__ uint32_t udiv(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    return (b & (b - 1)) == 0 ? a >> (__ffs(b) - 1) : a / b;
#else
    return a / b;  // (host code: the tests that compile the worker's arithmetic for the CPU)
#endif
}
__device__ __forceinline__ uint32_t umod(uint32_t a, uint32_t b) {
    return (b & (b - 1)) == 0 ? a & (b - 1) : a % b;
}

// Positions per attention chunk at pos (opcodes.attn_span, the plan's attn_spread): chunk c holds
// [c * span, min((c + 1) * span, pos + 1)) and runs when c * span <= pos. Thread 0 computes it once
// a step into af_span, which the attention and WO tasks read (host code too: a test compares it
// with the planner's rule at every position).
__host__ __device__ __forceinline__ uint32_t attn_span(const af_plan_consts& c, uint32_t pos) {
    if (c.attn_spread == 0) return c.attn_chunk;
    const uint32_t n = pos + 1;
    uint32_t chunks = min(min(c.attn_spread, c.attn_chunks), udiv(n, c.attn_min));
    if (c.attn_wide) chunks = max(chunks, min(min(c.attn_wide, c.attn_chunks), udiv(n, c.attn_wide_min)));
    if (chunks < 3) return c.attn_chunk;  // (never two chunks: opcodes.attn_span)
    return min(c.attn_chunk, (n + chunks - 1) / chunks);
}
__shared__ uint32_t af_span_shared;
__device__ __forceinline__ uint32_t af_span() { return *static_cast<volatile uint32_t*>(&af_span_shared); }
// The attention chunks active at pos, which the WO merge combines.
__device__ __forceinline__ uint32_t active_chunks(uint32_t pos) { return pos / af_span() + 1; }

// ---- arithmetic in the VM's order ---------------------------------------------------------
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ float madd(float acc, float a, float b) {
    return __fadd_rn(acc, __fmul_rn(a, b));  // no FMA: the VM rounds the product
}

#if AF_Q8
// ---- Q8_0 weights (AF_Q8): host code too, so that the tests decode bytes with the worker's own
// helpers --------------------------------------------------------------------------------------
__host__ __device__ __forceinline__ float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    __builtin_memcpy(&f, &u, 4);  // (NVRTC, which has no <cstring>, compiles only the branch above)
    return f;
#endif
}

// An integer as a float, rounded to nearest (exact for the quants and the f16 mantissas here).
// (int, not int32_t: plan_format.h gives NVRTC the unsigned fixed-width types only)
__host__ __device__ __forceinline__ float int_float(int v) {
#ifdef __CUDA_ARCH__
    return __int2float_rn(v);
#else
    return (float)v;
#endif
}

// The f16 in the low 16 bits of h as the f32 of the same value (NVRTC builds without
// cuda_fp16.h): a normal's exponent rebiased, a subnormal m * 2^-24 (exact), inf and NaN (payload
// kept) by their bits, the sign last.
__host__ __device__ __forceinline__ float f16_float(uint32_t h) {
    const uint32_t em = h & 0x7fffu;
    float mag;
    if (em >= 0x7c00u) mag = bits_float(0x7f800000u | (em << 13));
    else if (em < 0x0400u) mag = int_float((int)em) * 0x1p-24f;
    else mag = bits_float((em << 13) + 0x38000000u);  // exponent bias 15 -> 127
    return (h & 0x8000u) ? -mag : mag;
}

// Quant k (0..3) of a word of four int8, sign-extended: on the GPU one prmt with its sign
// replication, which __byte_perm leaves out.
__host__ __device__ __forceinline__ int q8_int(uint32_t word, uint32_t k) {
#ifdef __CUDA_ARCH__
    int q;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(q) : "r"(word), "r"(0x8880u + 0x1111u * k));
    return q;
#else
    return (signed char)(word >> (8 * k));
#endif
}

// Weight k (0..7) of 8 quants (8 bytes in element order) with their block's scale: f32(scale) *
// f32(q), exact in f32 (an 11-bit times an 8-bit significand), one rounded multiply that is never
// contracted into the dot product (the host's float multiply rounds the same).
__host__ __device__ __forceinline__ float q8_weight(float scale, uint2 q, uint32_t k) {
    const float v = int_float(q8_int(k < 4 ? q.x : q.y, k & 3));
#ifdef __CUDA_ARCH__
    return __fmul_rn(scale, v);
#else
    return scale * v;
#endif
}

// Bytes of a Q8 row of k columns (k % 32 == 0): its k quants, then k / 32 f16 scales (scale b for
// columns 32b..32b+31), zeros to a multiple of 16.
__host__ __device__ __forceinline__ constexpr uint32_t q8_row_bytes(uint32_t k) { return (k + k / 16 + 15) & ~15u; }
// From a row's first byte to the scale of its 8-column vector g.
__host__ __device__ __forceinline__ constexpr uint32_t q8_scale_at(uint32_t k, uint32_t g) { return k + 2 * (g / 4); }
// ffn_down, transposed (n_ff rows of e columns), in blocks of 32 rows of 34 e bytes: from the
// tensor's start to row f's block; in the block, the 8 quants of row f at columns 8col..8col+7,
// then those columns' 8 scales (scale r for column r of the block's 32 rows).
__host__ __device__ __forceinline__ uint64_t q8_down_block(uint32_t e, uint32_t f) {
    return (uint64_t)(f / 32) * 34 * e;
}
__host__ __device__ __forceinline__ constexpr uint32_t q8_down_quants(uint32_t e, uint32_t f, uint32_t col) {
    return (f % 32) * e + 8 * col;
}
__host__ __device__ __forceinline__ constexpr uint32_t q8_down_scales(uint32_t e, uint32_t col) { return 32 * e + 16 * col; }
#endif

// ---- xs, the vector a GEMV multiplies (two planes: AF_XS_PLANE_FLOATS) --------------------
// Where element i of the vector lives in xs.
__host__ __device__ __forceinline__ constexpr uint32_t xs_index(uint32_t i) {
    return ((i >> 2) & 1) * AF_XS_PLANE_FLOATS + ((i >> 3) << 2) + (i & 3);
}

// acc += w . x over 8 consecutive elements, in element order; x0 and x1 are the vector's two
// halves of 4 floats in shared memory.
__device__ __forceinline__ float dot8(uint4 w, const float* x0, const float* x1, float acc) {
    const float4 a = *reinterpret_cast<const float4*>(x0);
    const float4 b = *reinterpret_cast<const float4*>(x1);
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

#if AF_Q8
// dot8 for 8 quants q and their scale: each weight formed exactly, then multiplied and added.
__device__ __forceinline__ float dot8q(uint2 q, float scale, const float* x0, const float* x1, float acc) {
    const float4 a = *reinterpret_cast<const float4*>(x0);
    const float4 b = *reinterpret_cast<const float4*>(x1);
    acc = madd(acc, q8_weight(scale, q, 0), a.x);
    acc = madd(acc, q8_weight(scale, q, 1), a.y);
    acc = madd(acc, q8_weight(scale, q, 2), a.z);
    acc = madd(acc, q8_weight(scale, q, 3), a.w);
    acc = madd(acc, q8_weight(scale, q, 4), b.x);
    acc = madd(acc, q8_weight(scale, q, 5), b.y);
    acc = madd(acc, q8_weight(scale, q, 6), b.z);
    acc = madd(acc, q8_weight(scale, q, 7), b.w);
    return acc;
}

// madd8 for 8 quants q of an ffn_down row and their columns' scales s.
__device__ __forceinline__ void madd8q(float* acc, uint2 q, const float* s, float v) {
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = madd(acc[k], q8_weight(s[k], q, k), v);
}
#endif

// acc[k] += element k of the 8 BF16 values w times v, k = 0..7 (ffn_down: a row's 8 columns).
__device__ __forceinline__ void madd8(float* acc, uint4 w, float v) {
    acc[0] = madd(acc[0], bf16_lo(w.x), v);
    acc[1] = madd(acc[1], bf16_hi(w.x), v);
    acc[2] = madd(acc[2], bf16_lo(w.y), v);
    acc[3] = madd(acc[3], bf16_hi(w.y), v);
    acc[4] = madd(acc[4], bf16_lo(w.z), v);
    acc[5] = madd(acc[5], bf16_hi(w.z), v);
    acc[6] = madd(acc[6], bf16_lo(w.w), v);
    acc[7] = madd(acc[7], bf16_hi(w.w), v);
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

#if AF_Q8
// A list of Q8 rows: row i starts at byte p0 + i * stride for i < n0, at p1 + (i - n0) * stride
// after (FFN: the gate rows, then the up rows); kvec 8-element vectors of each are multiplied
// from vector `first` on (a split-K piece), and a row's scales start k bytes after it (its k quants).
struct af_rows {
    const uint8_t* p0;
    const uint8_t* p1;
    uint32_t n0, n, stride, kvec, first, k;
    __device__ __forceinline__ const uint8_t* row(uint32_t i) const {
        return i < n0 ? p0 + (size_t)i * stride : p1 + (size_t)(i - n0) * stride;
    }
};
#else
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
#endif

// U weight vectors of one row, lane `lane`'s of a chunk (vectors base + u * 32 + lane), loaded
// together and then multiplied in the VM's order.
template <int U>
struct af_chunk {
#if AF_Q8
    uint2 v[U];
    uint32_t s[U];  // vector j's f16 scale, that of its row's vector first + j
    __device__ __forceinline__ void load(const af_rows& r, const uint8_t* w, uint32_t base, uint32_t lane) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t j = base + u * 32 + lane, g = r.first + j;
            v[u] = j < r.kvec ? ld_weight8(w + 8 * g) : make_uint2(0, 0);
            s[u] = j < r.kvec ? ld_weight2(w + q8_scale_at(r.k, g)) : 0u;
        }
    }
    // acc + vector u . x (elements 8j.. of the vector xs holds in its planes)
    __device__ __forceinline__ float dot(int u, const float* xs, uint32_t j, float acc) const {
        return dot8q(v[u], f16_float(s[u]), xs + AF_XS_STEP * j, xs + AF_XS_PLANE_FLOATS + AF_XS_STEP * j, acc);
    }
#else
    uint4 v[U];
    __device__ __forceinline__ void load(const af_rows& r, const uint4* w, uint32_t base, uint32_t lane) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t j = base + u * 32 + lane;
            v[u] = j < r.kvec ? ld_weight16(w + j) : make_uint4(0, 0, 0, 0);
        }
    }
    __device__ __forceinline__ float dot(int u, const float* xs, uint32_t j, float acc) const {
        return dot8(v[u], xs + AF_XS_STEP * j, xs + AF_XS_PLANE_FLOATS + AF_XS_STEP * j, acc);
    }
#endif
};

// Rows 0..n-1 of the list . xs, one warp per row, in the VM's lane order: lane l owns the
// vectors j with j % 32 == l; U vectors per lane per chunk are loaded, then multiplied.
// `prologue()` fills xs (a norm, a merge) and ends with __syncthreads; `emit(i, value)` runs on
// lane 0. (Requesting the first chunk before or during the prologue, to hide its latency behind
// it, measured slower every way it was tried: in registers, through cp.async, before or after
// the prologue's own loads. The prologue's reads of L2 come back later with weights in flight.)
// xs points at the first vector multiplied (in plane 0).
template <int U, class Prologue, class Emit>
__device__ __forceinline__ void gemv_list(const af_rows& r, const float* xs, Prologue prologue, Emit emit) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t kvec = r.kvec;
    af_chunk<U> w8;
    prologue();
    trace_mark(1);
    for (uint32_t i = warp; i < r.n; i += AF_WARPS) {
        const auto* w = r.row(i);
        float acc = 0.0f;
        for (uint32_t base = 0; base < kvec; base += 32 * U) {
            w8.load(r, w, base, lane);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t j = base + u * 32 + lane;
                if (j < kvec) acc = w8.dot(u, xs, j, acc);
            }
        }
        acc = warp_fold(acc);
        if (lane == 0) emit(i, acc);
    }
}

// gemv_list for the B tokens of a prefill block: token b's vector in xs + b * AF_XS_FLOATS, each
// weight vector loaded once and multiplied with every token's (the same sums, token by token, as
// gemv_list's); `emit(i, b, value)` runs on lane 0.
template <int U, int B, class Emit>
__device__ __forceinline__ void gemv_block(const af_rows& r, const float* xs, Emit emit) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t kvec = r.kvec;
    af_chunk<U> w8;
    for (uint32_t i = warp; i < r.n; i += AF_WARPS) {
        const auto* w = r.row(i);
        float acc[B];
#pragma unroll
        for (int b = 0; b < B; ++b) acc[b] = 0.0f;
        for (uint32_t base = 0; base < kvec; base += 32 * U) {
            w8.load(r, w, base, lane);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const uint32_t j = base + u * 32 + lane;
                if (j < kvec) {
#pragma unroll
                    for (int b = 0; b < B; ++b) acc[b] = w8.dot(u, xs + b * AF_XS_FLOATS, j, acc[b]);
                }
            }
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float v = warp_fold(acc[b]);
            if (lane == 0) emit(i, b, v);
        }
    }
}

// Copy n floats of the arena into xs.
__device__ __forceinline__ void load_shared(float* xs, const float* src, uint32_t n) {
    for (uint32_t i = threadIdx.x; i < n; i += AF_THREADS) xs[xs_index(i)] = ld_act(src + i);
}

// RMSNorm's sum of squares comes in chunks of 128 elements (a warp's 32 quads).
__device__ __forceinline__ uint32_t norm_chunks(uint32_t n) { return (n + 127) / 128; }

// RMSNorm's sum of squares, the VM's order (vm.norm_sum): quad q (elements 4q..4q+3) from +0 in
// element order, folded in halves over the 32 quads of chunk q / 32 (a warp's lanes); lane 0
// leaves the chunk's sum in red[chunk]. `v` is zero for quads past n.
__device__ __forceinline__ void norm_partial(float4 v, float* red, uint32_t chunk) {
    float s = __fmul_rn(v.x, v.x);
    s = madd(s, v.y, v.y);
    s = madd(s, v.z, v.z);
    s = madd(s, v.w, v.w);
    s = warp_fold(s);
    if (threadIdx.x % 32 == 0) red[chunk] = s;
}

// 1 / sqrt(sum / n + eps), the chunks' sums (red) added in order from +0.
__device__ __forceinline__ float norm_scale(const float* red, uint32_t n, float eps) {
    float s = 0.0f;
    for (uint32_t c = 0; c < norm_chunks(n); ++c) s = __fadd_rn(s, red[c]);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s, (float)n), eps)));
}

// Adds v to an FFN sum (op_ffn's fixed-point atomics) as round(v * 2^32); `bad` is set when v is not
// finite or |v| >= 2^22 (512 such partials could overflow the accumulator).
__device__ __forceinline__ void fix_add(unsigned long long* acc, float v, bool& bad) {
    bad |= !(fabsf(v) < AF_FIX_LIMIT);  // NaN included
    const long long q = __float2ll_rn(__fmul_rn(v, AF_FIX_SCALE));
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(acc), "l"(q) : "memory");
}

// silu(gate) * up of one FFN row from its gate and up sums and the norm's scale they still lack.
__device__ __forceinline__ float silu_up(float gate_sum, float up_sum, float inv) {
    const float gate = __fmul_rn(gate_sum, inv), u = __fmul_rn(up_sum, inv);
    return __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), u);
}

// An FFN sum (op_ffn's fixed-point atomics) as a float: the accumulator rounded once, times 2^-32.
__device__ __forceinline__ float fix_value(unsigned long long v) {
    return __fmul_rn(__ll2float_rn((long long)v), AF_FIX_UNIT);
}

// Accumulator i of an FFN sum: the (wrapping, so exact) sum of its AF_FFN_COPIES copies,
// `stride` (n_embd) words apart.
__device__ __forceinline__ unsigned long long acc_total(const unsigned long long* acc, uint32_t i, uint32_t stride) {
    unsigned long long v = __ldcg(acc + i);
#pragma unroll
    for (int k = 1; k < AF_FFN_COPIES; ++k) v += __ldcg(acc + k * stride + i);
    return v;
}

// The residual stream entering a layer, as its readers see it: x (+ side) (+ the FFN sum acc).
struct af_x {
    const float* x;
    const float* side;                // null: none
    bool side_is_zero;                // a side vector no task writes: added as 0.0f
    const unsigned long long* acc;    // null: none
    // element i of n (n: the copies' stride, AF_FFN_COPIES)
    __device__ __forceinline__ float at(uint32_t i, uint32_t n) const {
        float v = ld_act(x + i);
        if (side) v = __fadd_rn(v, side_is_zero ? 0.0f : ld_act(side + i));
        if (acc) v = __fadd_rn(v, fix_value(acc_total(acc, i, n)));
        return v;
    }
};

// xs = rmsnorm(x) over n elements, exactly as the VM: inv = 1 / sqrt(sum(x * x) / n + eps) in
// norm_partial's order, y = (x * inv) * w, x as af_x forms it. With Defer (the QKV and FFN
// tasks), xs = x * w and red holds the chunk sums: the reader of the GEMV's outputs multiplies
// them by norm_scale(red, n, eps) (vm.rmsnorm_deferred), so that the rows start after one block
// barrier. `red` is shared scratch of 32 floats.
template <bool Defer>
__device__ void rmsnorm_shared(float* xs, const af_x& in, const float* w, uint32_t n, float eps, float* red) {
    if (n % 8 == 0 && n <= 4 * AF_THREADS) {
        // quad q = threadIdx.x: x[4q, 4q + 4) (+ side, + the FFN sums) and its weights, in registers
        const uint32_t q = threadIdx.x;
        const bool mine = q < n / 4;
        float4 xv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), wv = xv;
        if (mine) {
            wv = __ldg(reinterpret_cast<const float4*>(w) + q);
            xv = __ldcg(reinterpret_cast<const float4*>(in.x) + q);
            ulonglong2 a0 = make_ulonglong2(0, 0), a1 = a0;
            if (in.acc) {
                a0 = __ldcg(reinterpret_cast<const ulonglong2*>(in.acc) + 2 * q);
                a1 = __ldcg(reinterpret_cast<const ulonglong2*>(in.acc) + 2 * q + 1);
                // (acc_total's sum for two accumulators at once, written out: a shared helper gave
                // the same bits but a kernel that ptxas laid out slower at long contexts)
#pragma unroll
                for (int k = 1; k < AF_FFN_COPIES; ++k) {
                    const ulonglong2* cp = reinterpret_cast<const ulonglong2*>(in.acc + k * n);
                    const ulonglong2 b0 = __ldcg(cp + 2 * q), b1 = __ldcg(cp + 2 * q + 1);
                    a0 = make_ulonglong2(a0.x + b0.x, a0.y + b0.y);
                    a1 = make_ulonglong2(a1.x + b1.x, a1.y + b1.y);
                }
            }
            if (in.side) {
                const float4 sv = in.side_is_zero ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                                                  : __ldcg(reinterpret_cast<const float4*>(in.side) + q);
                xv = make_float4(__fadd_rn(xv.x, sv.x), __fadd_rn(xv.y, sv.y), __fadd_rn(xv.z, sv.z),
                                 __fadd_rn(xv.w, sv.w));
            }
            if (in.acc)
                xv = make_float4(__fadd_rn(xv.x, fix_value(a0.x)), __fadd_rn(xv.y, fix_value(a0.y)),
                                 __fadd_rn(xv.z, fix_value(a1.x)), __fadd_rn(xv.w, fix_value(a1.y)));
        }
        if (q / 32 < norm_chunks(n)) norm_partial(xv, red, q / 32);
        if (Defer) {
            if (mine)
                *reinterpret_cast<float4*>(xs + xs_index(4 * q)) =
                    make_float4(__fmul_rn(xv.x, wv.x), __fmul_rn(xv.y, wv.y), __fmul_rn(xv.z, wv.z),
                                __fmul_rn(xv.w, wv.w));
            __syncthreads();
            return;
        }
        __syncthreads();
        const float inv = norm_scale(red, n, eps);
        if (mine)
            *reinterpret_cast<float4*>(xs + xs_index(4 * q)) = make_float4(
                __fmul_rn(__fmul_rn(xv.x, inv), wv.x), __fmul_rn(__fmul_rn(xv.y, inv), wv.y),
                __fmul_rn(__fmul_rn(xv.z, inv), wv.z), __fmul_rn(__fmul_rn(xv.w, inv), wv.w));
        __syncthreads();
        return;
    }
    // a width the quad form does not take (none that check_model_limits lets through): x into
    // xs first, then the chunk sums from there
    for (uint32_t i = threadIdx.x; i < n; i += AF_THREADS) xs[xs_index(i)] = in.at(i, n);
    __syncthreads();
    const uint32_t lane = threadIdx.x % 32;
    for (uint32_t chunk = threadIdx.x / 32; chunk < norm_chunks(n); chunk += AF_WARPS) {
        const uint32_t q = 32 * chunk + lane;
        const float4 v = 4 * q < n ? *reinterpret_cast<const float4*>(xs + xs_index(4 * q))
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        norm_partial(v, red, chunk);
    }
    __syncthreads();
    const float inv = Defer ? 1.0f : norm_scale(red, n, eps);
    for (uint32_t i = threadIdx.x; i < n; i += AF_THREADS) {
        float& xi = xs[xs_index(i)];
        xi = Defer ? __fmul_rn(xi, __ldg(w + i)) : __fmul_rn(__fmul_rn(xi, inv), __ldg(w + i));
    }
    __syncthreads();
}

__device__ __forceinline__ const float* f32_at(const af_args& a, uint64_t offset) {
    return reinterpret_cast<const float*>(a.weights + offset);
}

// The activation arena of token `tok` of a prefill block (worker_prefill.cuh): the block's tokens
// have an arena each, act_size floats apart; a decode step has one (tok 0).
__device__ __forceinline__ float* arena(const af_args& a, uint32_t tok) { return a.act + (size_t)tok * a.c.act_size; }

// x[l]: the residual stream entering layer l (x[n_layers] leaves the last layer).
__device__ __forceinline__ float* x_at(const af_args& a, uint32_t l, uint32_t tok = 0) {
    return arena(a, tok) + a.c.act_x + (size_t)l * a.c.act_x_stride;
}

// Layer l's block of the arena; add lay_qkv, lay_attn, lay_h or lay_ffn.
__device__ __forceinline__ float* layer_at(const af_args& a, uint32_t l, uint32_t region, uint32_t tok = 0) {
    return arena(a, tok) + a.c.act_layer + (size_t)l * a.c.act_layer_size + region;
}

// Layer l's FFN sum, n_embd 64-bit accumulators at the start of its ffn region
// (the slots, unused then; the arena's regions are 256-byte aligned).
__device__ __forceinline__ unsigned long long* ffn_acc(const af_args& a, uint32_t l, uint32_t tok = 0) {
    return reinterpret_cast<unsigned long long*>(layer_at(a, l, a.c.lay_ffn, tok));
}

// x[l], the residual stream entering layer l (l = n_layers: leaving the last one), as its
// readers see it: past layer 0, (h + h_side) of layer l - 1 + its FFN sum.
__device__ __forceinline__ af_x x_in(const af_args& a, uint32_t l, uint32_t tok = 0) {
    if (l == 0) return af_x{x_at(a, l, tok), nullptr, false, nullptr};
    return af_x{layer_at(a, l - 1, a.c.lay_h, tok), layer_at(a, l - 1, a.c.lay_h_side, tok), !side_live(2),
                ffn_acc(a, l - 1, tok)};
}
