// latency_probe.cu: the kernels of latency_probe.py (beside this file), which compiles them with
// nvcc and times what one step of a megakernel chain costs. Not part of the worker.
#include <stdint.h>
__device__ __forceinline__ unsigned long long ns() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
    uint32_t v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void grid_sync(uint32_t* counter, uint32_t& target) {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
        while (ld_acquire(counter) < target) {}
    }
    __syncthreads();
}

// red[0] = the sum of xs[0..n), added up by the block's first warp (the rest of the block idles).
__device__ __forceinline__ void sum_by_warp0(const float* xs, int n, float* red) {
    if (threadIdx.x < 32) {
        float acc = 0.f;
        for (int i = threadIdx.x; i < n; i += 32) acc += xs[i];
        for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (threadIdx.x == 0) red[0] = acc;
    }
}

// out[it * grid + block] = consume time in ns; mode 0: read n floats of copy block % copies;
// mode 1: thread 0 reads one float written by block + 1 (a bare round trip to L2);
// mode 2: barrier only (out = time from this block's arrival to its release); mode 3: as 0, the
// time from the start of the block's writes to the end of its read (writes + barrier + read).
extern "C" __global__ void __launch_bounds__(1024, 1)
probe(float* x, uint32_t* bar, unsigned long long* out, int iters, int copies, int n, int mode) {
    __shared__ float xs[8192];
    __shared__ float red[2];
    uint32_t target = 0;
    const int G = gridDim.x, b = blockIdx.x;
    const int per = (n + G - 1) / G;
    for (int it = 0; it < iters; ++it) {
        for (int r = b * per + threadIdx.x; r < min(n, (b + 1) * per); r += 1024)
            for (int k = 0; k < copies; ++k) x[(size_t)k * 8192 + r] = (float)(it + r);
        unsigned long long t0 = ns();
        const unsigned long long t_iter = t0;
        grid_sync(bar, target);
        if (mode == 2) { if (threadIdx.x == 0) out[it * G + b] = ns() - t0; continue; }
        t0 = ns();
        if (mode == 0 || mode == 3) {
            const float* src = x + (size_t)(b % copies) * 8192;
            for (int i = threadIdx.x; i < n; i += 1024) xs[i] = __ldcg(src + i);
            __syncthreads();
            sum_by_warp0(xs, n, red);
            __syncthreads();
        } else if (threadIdx.x == 0) {
            red[0] = __ldcg(x + ((b + 1) % G) * per);
        }
        __syncthreads();
        if (threadIdx.x == 0) out[it * G + b] = ns() - (mode == 3 ? t_iter : t0) + (red[0] == -1.f ? 1 : 0);
        grid_sync(bar, target);
    }
}

// Instruction fetch: BODY_LEN dependent FMAs (16 bytes each) per body, N_BODIES bodies of
// different code. icache(): every thread of every block runs body (it % kinds) at iteration it,
// out[it * grid + block] = its time in ns. kinds = 1 keeps one body's code hot; kinds = N_BODIES
// walks over N_BODIES * BODY_LEN * 16 bytes of code, as the worker walks over its opcodes.
#define BODY_LEN 256
#define N_BODIES 48
template <int V> __device__ __noinline__ float body(float v) {
#pragma unroll
    for (int i = 0; i < BODY_LEN; ++i) v = __fmaf_rn(v, 1.0f + (V + 1) * 1e-7f, (i + 1) * 1e-6f);
    return v;
}
template <int V> __device__ __forceinline__ float pick(int k, float v) {
    if constexpr (V == N_BODIES) return v;
    else return k == V ? body<V>(v) : pick<V + 1>(k, v);
}
extern "C" __global__ void __launch_bounds__(1024, 1)
icache(unsigned long long* out, float* sink, int iters, int kinds) {
    float v = threadIdx.x * 1e-3f;
    for (int it = 0; it < iters; ++it) {
        __syncthreads();
        const unsigned long long t0 = ns();
        v = pick<0>(it % kinds, v);
        __syncthreads();
        if (threadIdx.x == 0) out[it * gridDim.x + blockIdx.x] = ns() - t0;
    }
    if (v == -1.f) sink[0] = v;
}

// Address translation: before each round every block reads 16 bytes from each of `pages`
// 2 MiB pages of `big` (its own offset inside each page, so the L2 holds only a few KiB more),
// as the weight stream touches many pages between two uses of an activation. Then the round of
// probe mode 1: thread 0's time to read one float that another block has just written.
// scatter = 1 writes those floats as a GEMV's lane 0s do, one 4-byte store per warp.
extern "C" __global__ void __launch_bounds__(1024, 1)
pages(float* x, uint32_t* bar, unsigned long long* out, const uint4* big, int iters, int n_pages, int scatter) {
    __shared__ float red[2];
    uint32_t target = 0, sink = 0;
    const int G = gridDim.x, b = blockIdx.x;
    for (int it = 0; it < iters; ++it) {
        for (int p = threadIdx.x; p < n_pages; p += 1024) {
            const uint4 v = __ldcg(big + ((size_t)((p + it) % n_pages) << 17) + b * 16);
            sink ^= v.x;
        }
        // the 32 floats: one warp's store, or (scatter) one float from lane 0 of each warp, as a
        // GEMV's results are written
        if (scatter ? threadIdx.x % 32 == 0 : threadIdx.x < 32) {
            const int i = scatter ? threadIdx.x / 32 : threadIdx.x;
            x[b * 32 + i] = (float)(it + i);
        }
        grid_sync(bar, target);
        const unsigned long long t0 = ns();
        if (threadIdx.x == 0) red[0] = __ldcg(x + ((b + 1) % G) * 32);
        __syncthreads();
        if (threadIdx.x == 0) out[it * G + b] = ns() - t0 + (red[0] == -1.f ? 1 : 0);
        grid_sync(bar, target);
    }
    if (sink == 0x12345u) x[0] = 0.0f;
}

// Cross-block sums, as the end of a layer's FFN needs them: every block holds 2048 partial sums
// (its ffn_down columns); every block then needs all 2048 totals (the next norm). At iteration
// start (after a barrier) block b first idles stagger * b / grid ns (blocks finish the FFN at
// different times), then, mode 0 (the plan's way): writes its slot, barrier, reduces its rows of
// all slots and writes them, barrier, reads all 2048 totals; mode 1: adds its partials to 2048
// 64-bit fixed-point accumulators (red.global.add.u64, 2^-32 units: integer sums are exact, so
// the total does not depend on the order), barrier, reads the accumulators. out = ns from the
// start to the totals in shared memory.
extern "C" __global__ void __launch_bounds__(1024, 1)
sums(float* slots, float* total, unsigned long long* acc, uint32_t* bar, unsigned long long* out, int iters,
     int mode, int stagger) {
    __shared__ float xs[2048];
    __shared__ float part[1024];
    uint32_t target = 0;
    const int G = gridDim.x, b = blockIdx.x, t = threadIdx.x;
    for (int it = 0; it < iters; ++it) {
        acc[t] = 0ull;  // the accumulators are zeroed a wave ahead (untimed here)
        acc[t + 1024] = 0ull;
        grid_sync(bar, target);
        const unsigned long long t0 = ns();
        if (t == 0) while (ns() - t0 < (unsigned long long)stagger * b / G) {}
        __syncthreads();
        const float p0 = 1e-3f * (b + t), p1 = 1e-3f * (b - t);  // this block's partials
        if (mode == 0) {
            slots[(size_t)b * 2048 + t] = p0;
            slots[(size_t)b * 2048 + t + 1024] = p1;
            grid_sync(bar, target);
            const int per = (2048 + G - 1) / G, r0 = b * per;  // rows r0 .. r0 + per - 1
            const int row = t / 64, lane = t % 64;              // 16 rows a pass, 64 threads a row
            float s = 0.f;
            if (row < per && r0 + row < 2048)
                for (int k = lane; k < G; k += 64) s += __ldcg(slots + (size_t)k * 2048 + r0 + row);
            part[t] = s;
            __syncthreads();
            if (lane == 0 && row < per && r0 + row < 2048) {
                float v = 0.f;
                for (int k = 0; k < 64; ++k) v += part[t + k];
                total[r0 + row] = v;
            }
            grid_sync(bar, target);
            xs[t] = __ldcg(total + t);
            xs[t + 1024] = __ldcg(total + t + 1024);
        } else {
            asm volatile("red.global.add.u64 [%0], %1;" :: "l"(acc + t), "l"((unsigned long long)__float2ll_rn(p0 * 4294967296.0f)) : "memory");
            asm volatile("red.global.add.u64 [%0], %1;" :: "l"(acc + t + 1024), "l"((unsigned long long)__float2ll_rn(p1 * 4294967296.0f)) : "memory");
            grid_sync(bar, target);
            xs[t] = __ll2float_rn((long long)__ldcg(acc + t)) * 2.3283064365386963e-10f;
            xs[t + 1024] = __ll2float_rn((long long)__ldcg(acc + t + 1024)) * 2.3283064365386963e-10f;
        }
        __syncthreads();
        if (t == 0) out[it * G + b] = ns() - t0 + (xs[5] == -1.f ? 1 : 0);
        grid_sync(bar, target);
    }
}

// Barrier forms (the "clusters" part). Every iteration warp 0 of block b writes 32 floats, the
// block passes one barrier of the given form, and thread 0 reads the floats block b + 1 wrote
// (a stale value counts as an error: the form's ordering checked, not only its time).
// out[it * grid + b] = ns from arrival to release; out2 = ns to the read's value in hand.
// form 0: the worker's counter (red.release + ld.acquire polling by thread 0);
// form 1: a flag per block (st.release), warp 0 polls every flag with relaxed loads, then a fence;
// form 2: as 1 with acquire loads and no fence; form 3: as 1 with each flag on its own 32-byte
// sector; form 4: four counters (block b arrives at counter b % 4), lanes 0-3 poll one each;
// form 5 (cluster launch): a cluster barrier, rank 0's thread 0 arrives and polls the counter
// for the clusters, a cluster barrier; form 6 (cluster launch): a cluster barrier alone.
__device__ __forceinline__ uint32_t ld_relaxed(const uint32_t* p) {
    uint32_t v; asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
// (thread-block clusters exist from sm_90 on; the forms that use them trap on older GPUs, and
// the host does not launch them there)
#if __CUDA_ARCH__ >= 900
#define AF_CLUSTERS 1
#else
#define AF_CLUSTERS 0
#endif
__device__ __forceinline__ void cluster_sync_all() {
#if AF_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
#if AF_CLUSTERS
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ uint32_t cluster_size() {
    uint32_t r = 1;
#if AF_CLUSTERS
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
#endif
    return r;
}
// st.shared::cluster of v to `local`'s place in the shared memory of cluster block `rank`
__device__ __forceinline__ void store_remote(long long* local, uint32_t rank, long long v) {
#if AF_CLUSTERS
    uint32_t here = (uint32_t)__cvta_generic_to_shared(local), there;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(there) : "r"(here), "r"(rank));
    asm volatile("st.shared::cluster.s64 [%0], %1;" :: "r"(there), "l"(v) : "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void form_sync(int form, uint32_t* bar, uint32_t& k) {
    const int G = gridDim.x;
    ++k;
    if (form == 0) {
        __syncthreads();
        if (threadIdx.x == 0) {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(bar) : "memory");
            while (ld_acquire(bar) < k * G) {}
        }
        __syncthreads();
    } else if (form <= 3) {
        const int stride = form == 3 ? 8 : 1;
        uint32_t* flags = bar + 64;
        __syncthreads();
        if (threadIdx.x < 32) {
            if (threadIdx.x == 0)
                asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(flags + blockIdx.x * stride), "r"(k) : "memory");
            __syncwarp();
            for (;;) {
                bool ok = true;
#pragma unroll
                for (int j = 0; j < 5; ++j) {
                    const int b = threadIdx.x + 32 * j;
                    if (b < G) ok &= (form == 2 ? ld_acquire(flags + b * stride) : ld_relaxed(flags + b * stride)) >= k;
                }
                if (__all_sync(0xffffffffu, ok)) break;
            }
            if (form != 2) asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
        __syncthreads();
    } else if (form == 4) {
        uint32_t* ctr = bar + 2048;
        __syncthreads();
        if (threadIdx.x < 32) {
            if (threadIdx.x == 0)
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(ctr + (blockIdx.x % 4) * 32) : "memory");
            __syncwarp();
            const uint32_t lane = threadIdx.x, members = (G - lane + 3) / 4;
            for (;;) {
                const bool ok = lane >= 4 || ld_acquire(ctr + lane * 32) >= k * members;
                if (__all_sync(0xffffffffu, ok)) break;
            }
        }
        __syncthreads();
    } else if (form == 5) {
        cluster_sync_all();
        if (cluster_rank() == 0 && threadIdx.x == 0) {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(bar) : "memory");
            const uint32_t clusters = G / cluster_size();
            while (ld_acquire(bar) < k * clusters) {}
        }
        cluster_sync_all();
    } else {
        cluster_sync_all();
    }
}

extern "C" __global__ void __launch_bounds__(1024, 1)
barriers(float* x, uint32_t* bar, unsigned long long* out, uint32_t* errors, int iters, int form) {
    __shared__ float red[2];
    uint32_t k = 0;
    const int G = gridDim.x, b = blockIdx.x;
    for (int it = 0; it < iters; ++it) {
        if (threadIdx.x < 32) x[b * 32 + threadIdx.x] = (float)(it + 1);
        const unsigned long long t0 = ns();
        form_sync(form, bar, k);
        const unsigned long long t1 = ns();
        if (threadIdx.x == 0) red[0] = __ldcg(x + ((b + 1) % G) * 32 + 5);
        __syncthreads();
        if (threadIdx.x == 0) {
            out[it * G + b] = t1 - t0;
            out[(iters + it) * G + b] = ns() - t0;
            if (red[0] < (float)(it + 1)) atomicAdd(errors, 1u);
        }
        form_sync(form, bar, k);  // nobody writes the next round before every block has read
    }
}

// The FFN's end in other forms (the "clusters" part): every block holds 2048 partials and every
// block then needs the 2048 totals. mode 1: two red.global.add.u64 a thread (the worker's way);
// mode 2: the blocks of a cluster (launched with 2 or 4) first combine their partials in
// distributed shared memory (each rank owns 2048 / n rows; the others store their fixed-point
// values into its inbox), then each rank adds its rows, one atomic a row: n times fewer
// atomics; mode 3: two copies of the accumulators (even blocks add to one, odd to the other),
// the readers add both. Then the worker's grid barrier and the read of the totals.
// out = ns from the start to the totals in shared memory; errors counts wrong totals.
extern "C" __global__ void __launch_bounds__(1024, 1)
csums(unsigned long long* acc, uint32_t* bar, unsigned long long* out, uint32_t* errors, int iters, int mode) {
    __shared__ float xs[2048];
    __shared__ long long inbox[2048];
    uint32_t k = 0;
    const int G = gridDim.x, b = blockIdx.x, t = threadIdx.x;
    const uint32_t n = mode == 2 ? cluster_size() : 1, r = mode == 2 ? cluster_rank() : 0, per = 2048 / n;
    for (int it = 0; it < iters; ++it) {
        acc[t] = 0ull;
        acc[t + 1024] = 0ull;
        acc[t + 2048] = 0ull;
        acc[t + 3072] = 0ull;
        form_sync(0, bar, k);
        const unsigned long long t0 = ns();
        const long long q0 = (long long)(b + t) << 20, q1 = (long long)(b - t) << 20;  // the partials
        if (mode == 1 || mode == 3) {
            unsigned long long* dst = acc + (mode == 3 ? (b & 1) * 2048 : 0);
            asm volatile("red.global.add.u64 [%0], %1;" :: "l"(dst + t), "l"(q0) : "memory");
            asm volatile("red.global.add.u64 [%0], %1;" :: "l"(dst + t + 1024), "l"(q1) : "memory");
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t row = t + 1024 * h, owner = row / per;
                const long long q = h ? q1 : q0;
                const uint32_t slot = r * per + row % per;  // the owner's inbox: [source rank][row]
                if (owner == r) {
                    inbox[slot] = q;
                } else {
                    store_remote(inbox + slot, owner, q);
                }
            }
            cluster_sync_all();
            if (t < per) {
                long long s = 0;
                for (uint32_t src = 0; src < n; ++src) s += inbox[src * per + t];
                asm volatile("red.global.add.u64 [%0], %1;" :: "l"(acc + r * per + t), "l"(s) : "memory");
            }
        }
        form_sync(0, bar, k);
        for (int i = t; i < 2048; i += 1024) {
            long long v = (long long)__ldcg(acc + i);
            if (mode == 3) v += (long long)__ldcg(acc + 2048 + i);
            xs[i] = (float)v;
        }
        __syncthreads();
        if (t == 0) out[it * G + b] = ns() - t0;
        // expected: sum over blocks of (b + i) << 20 (rows i < 1024), (b - (i - 1024)) << 20 after
        if (t < 2) {
            const long long i = t ? 1500 : 7, sb = (long long)G * (G - 1) / 2;
            const long long want = (i < 1024 ? sb + G * i : sb - G * (i - 1024)) << 20;
            if (xs[i] != (float)want) atomicAdd(errors, 1u);
        }
        form_sync(0, bar, k);
    }
}

// A chain of waves as the worker runs them: every block writes its slice of an n-float vector,
// then needs the whole vector (read into shared memory and summed, the sum feeding its next
// slice), then works work_ns (+ up to 240 ns more on some blocks, as GEMVs finish unevenly).
// mode 0: the worker's way, write, grid barrier, read. mode 1: every value carries its step in
// the high half of a 64-bit word and the read is the wait (each thread re-reads its words until
// they carry the step; no barrier). mode 2: as 1, the words stored with release and read with
// acquire (what a worker needs when other data, the K/V rows, must be visible with them). The
// vector alternates between two buffers, so a fast block never overwrites one still being read.
// out[it * grid + block] = ns at the end of wave it; check counts values that came out wrong.
__device__ __forceinline__ void st_word(unsigned long long* p, unsigned long long v, int mode) {
    if (mode == 2) asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
    else asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_word(const unsigned long long* p, int mode) {
    unsigned long long v;
    if (mode == 2) asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    else asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
extern "C" __global__ void __launch_bounds__(1024, 1)
tags(float* x, unsigned long long* words, uint32_t* bar, unsigned long long* out, uint32_t* check,
     int iters, int n, int mode, int work_ns, uint32_t step0) {
    __shared__ float xs[8192];
    __shared__ float red[1];
    uint32_t target = 0;
    const int G = gridDim.x, b = blockIdx.x, per = (n + G - 1) / G;
    float carry = 0.f;
    for (int it = 0; it < iters; ++it) {
        const uint32_t step = step0 + it;
        const size_t buf = (size_t)(it & 1) * 8192;
        for (int r = b * per + threadIdx.x; r < min(n, (b + 1) * per); r += 1024) {
            const float v = carry + (float)r;
            if (mode == 0) x[buf + r] = v;
            else st_word(words + buf + r, ((unsigned long long)step << 32) | __float_as_uint(v), mode);
        }
        if (mode == 0) {
            grid_sync(bar, target);
            for (int i = threadIdx.x; i < n; i += 1024) xs[i] = __ldcg(x + buf + i);
        } else {
            for (int i = threadIdx.x; i < n; i += 1024) {
                unsigned long long w = ld_word(words + buf + i, mode);
                while ((uint32_t)(w >> 32) != step) w = ld_word(words + buf + i, mode);
                xs[i] = __uint_as_float((uint32_t)w);
            }
        }
        __syncthreads();
        sum_by_warp0(xs, n, red);
        // every element is carry + its index, the same carry in every block
        if (threadIdx.x == 1 && xs[n - 1] != carry + (float)(n - 1)) atomicAdd(check, 1u);
        __syncthreads();
        carry = red[0] * 1e-9f;
        const unsigned long long t = ns(), until = t + work_ns + (work_ns ? (b * 7 % 13) * 20 : 0);
        if (threadIdx.x == 0) out[it * G + b] = t;
        while (ns() < until) {}
        __syncthreads();
    }
}

// Resolution of %globaltimer and the SM clock: out[0] = smallest nonzero step seen, out[1] = ns,
// out[2] = clock64 cycles over the same spin.
extern "C" __global__ void clocks(unsigned long long* out) {
    unsigned long long t0 = ns(), c0 = clock64(), last = t0, step = ~0ull;
    while (ns() - t0 < 200000) {
        const unsigned long long t = ns();
        if (t != last) { if (t - last < step) step = t - last; last = t; }
    }
    out[0] = step; out[1] = ns() - t0; out[2] = clock64() - c0;
}
