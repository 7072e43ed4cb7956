// worker_sample.cuh: drawing a sampled token inside the kernel. The host's chain
// (airframe/sampling.py: logit bias, repetition penalty, presence and frequency penalties, top-k,
// top-p, min-p, temperature, the draw) over the step's float32 logits, in float64 as the host
// computes it, so that a step draws the token Sampler.sample() picks from the same logits.
// Each LM_HEAD task keeps its rows' top_k penalised logits (lm_candidates); the step's end picks
// the top_k of all of them and draws from those (draw_token), every block alike.
#pragma once

#define AF_SAMPLE_K 64         // top_k at most: candidates per LM_HEAD slot and drawn from
// af_sampling.flags: which steps of the chain run
#define AF_S_BIAS 1u           // logit_bias
#define AF_S_REPEAT 2u         // the repetition penalty over the last last_n tokens
#define AF_S_COUNTS 4u         // the presence and frequency penalties
#define AF_S_TOP_P 8u
#define AF_S_MIN_P 16u
#define AF_S_TEMPERATURE 32u   // a temperature other than 1
#define AF_S_GREEDY 64u        // temperature 0: the penalised argmax, lowest id among ties
// shared memory of draw_token and lm_candidates from sm: a histogram, 4 words, then per candidate
// its value, sorted value, probability (double), id, sorted id and rank; then a key (8 bytes) per
// LM_HEAD row of a task or per candidate of a step, whichever are more (runtime.sample_floats).
#define AF_SAMPLE_SHARED_FLOATS (256 + 4 + 3 * 2 * AF_SAMPLE_K + 3 * AF_SAMPLE_K)

// What the host sets for a launch whose drawn steps sample (af_args.samp), in device memory.
struct af_sampling {
    uint32_t top_k;        // 1..AF_SAMPLE_K
    uint32_t flags;        // AF_S_*
    uint32_t last_n;       // the repetition window in tokens; 0: the whole history
    uint32_t hist_len;     // tokens in hist through the one step n_forced - 1 runs
    uint32_t n_prompt;     // hist index of the first generated token
    uint32_t reserved[3];
    double top_p, log_min_p, temperature, repeat_penalty, presence, frequency;
    const double* bias;    // (vocab): logit_bias, with AF_S_BIAS
    uint32_t* win;         // (2, vocab): times each token is in the window, of state (step & 1)
    uint32_t* gen;         // (2, vocab): times each token was generated, of state (step & 1)
    uint32_t* hist;        // (ctx): the request's tokens; the kernel appends those it draws
    uint32_t* cand;        // (lm_parts, AF_SAMPLE_K, 4): each LM_HEAD slot's top_k candidates, key (2 words) and id
    float u[AF_MAX_STEPS]; // u[j]: the random number in [0, 1) of the launch's j-th drawn token (step n_forced - 1 + j)
};

// Row r's logit v after the bias and penalties, in float64 and in the host's order; -0.0 as +0.0,
// so that equal values have one key. The state arrays change during a launch: read from L2.
__device__ __forceinline__ double penalised(const af_sampling& s, uint32_t vocab, uint32_t state, uint32_t r, float v) {
    double p = (double)v;
    if (s.flags & AF_S_BIAS) p += __ldg(s.bias + r);
    if ((s.flags & AF_S_REPEAT) && __ldcg(s.win + state * vocab + r) != 0u)
        p = p > 0.0 ? p / s.repeat_penalty : p * s.repeat_penalty;
    if (s.flags & AF_S_COUNTS) {
        const uint32_t g = __ldcg(s.gen + state * vocab + r);
        if (g != 0u) p -= s.frequency * (double)g + s.presence;
    }
    return p == 0.0 ? 0.0 : p;
}

// A 64-bit key that orders as the double does (no NaN reaches here).
__device__ __forceinline__ unsigned long long order_key(double p) {
    const unsigned long long b = (unsigned long long)__double_as_longlong(p);
    return (b >> 63) ? ~b : b | 0x8000000000000000ull;
}

// The double whose order_key is k.
__device__ __forceinline__ double key_value(unsigned long long k) {
    return __longlong_as_double((long long)((k >> 63) ? k & 0x7fffffffffffffffull : ~k));
}

// The want-th largest of keys[0..n) (shared memory) where held(e) (at least want of them), as cut,
// and how many of the held keys equal to it are among the want largest (at_cut): a radix select,
// 8 bits a pass from bit `bits` down. It stops early (whole) once all the held keys of the cut's
// bucket are among the largest: then cut has the bucket's digits and zeros below, and the want
// largest are the held keys >= cut. Every thread calls it.
template <class Key, class Held>
__device__ void select_largest(const Key* keys, uint32_t n, Held held, uint32_t want, int bits, uint32_t* hist,
                               uint32_t* out, Key& cut, uint32_t& at_cut, bool& whole) {
    whole = false;
    Key prefix = 0, mask = 0;
    for (int shift = bits - 8; shift >= 0; shift -= 8) {
        if (threadIdx.x < 256) hist[threadIdx.x] = 0;
        __syncthreads();
        for (uint32_t e = threadIdx.x; e < n; e += AF_THREADS) {
            // the lanes whose digit is the warp's first lane's add to its count once: keys near
            // each other share their high digits, and one atomic per key on one count serializes
            const Key key = keys[e];
            const bool take = (key & mask) == prefix && held(e);
            const uint32_t digit = (uint32_t)((key >> shift) & 255u);
            const uint32_t same = __ballot_sync(__activemask(), take && digit == (uint32_t)((keys[e & ~31u] >> shift) & 255u));
            if (take && (same >> (threadIdx.x % 32) & 1u)) {
                if (threadIdx.x % 32 == (uint32_t)__ffs(same) - 1) atomicAdd(hist + digit, __popc(same));
            } else if (take) {
                atomicAdd(hist + digit, 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // lane l counts digits 255 - 8l down to 248 - 8l, in registers
            const uint32_t lane = threadIdx.x;
            const uint4 lo = *reinterpret_cast<const uint4*>(hist + 248 - 8 * lane);
            const uint4 hi = *reinterpret_cast<const uint4*>(hist + 252 - 8 * lane);
            const uint32_t count[8] = {hi.w, hi.z, hi.y, hi.x, lo.w, lo.z, lo.y, lo.x};
            uint32_t sum = 0;
#pragma unroll
            for (int q = 0; q < 8; ++q) sum += count[q];
            uint32_t upto = sum;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const uint32_t o = __shfl_up_sync(0xffffffffu, upto, off);
                if (lane >= (uint32_t)off) upto += o;
            }
            uint32_t above = upto - sum;  // keys with a larger digit
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                const uint32_t c = count[q];
                if (above < want && above + c >= want) {
                    out[0] = 255 - 8 * lane - q;
                    out[1] = want - above;
                    out[2] = c;
                }
                above += c;
            }
        }
        __syncthreads();
        prefix |= (Key)out[0] << shift;
        mask |= (Key)255u << shift;
        want = out[1];
        whole = out[2] == want;
        __syncthreads();  // out read by all before the next pass writes it
        if (whole) break;
    }
    cut = prefix;
    at_cut = want;
}

// The `want` largest of keys[0..n) (shared memory), ties at the cut going to the lowest ids
// (id_of(e), read only where ties must be split, in place of the ties' keys for a while): emit(e)
// for each, in no order. out: 4 words.
template <class IdOf, class Emit>
__device__ void pick_largest(unsigned long long* keys, uint32_t n, uint32_t want, uint32_t* hist,
                             uint32_t* out, IdOf id_of, Emit emit) {
    unsigned long long cut;
    uint32_t at_cut;
    bool whole;
    select_largest(keys, n, [](uint32_t) { return true; }, want, 64, hist, out, cut, at_cut, whole);
    if (whole) {  // no ties to split
        for (uint32_t e = threadIdx.x; e < n; e += AF_THREADS)
            if (keys[e] >= cut) emit(e);
        __syncthreads();  // (hist and out free again)
        return;
    }
    if (threadIdx.x == 0) out[2] = 0;
    __syncthreads();
    uint32_t ties = 0;
    for (uint32_t e = threadIdx.x; e < n; e += AF_THREADS) ties += keys[e] == cut;
    if (ties) atomicAdd(out + 2, ties);
    __syncthreads();
    const bool split = out[2] != at_cut;
    uint32_t last_id = 0xffffffffu;  // ties with ids up to this one are taken
    if (split) {  // the at_cut lowest ids of the ties: the largest of 2^32 - 1 - id, which stands in
        // for each tie's key meanwhile (a finite value's key never has a zero high word), then the cut
        for (uint32_t e = threadIdx.x; e < n; e += AF_THREADS)
            if (keys[e] == cut) keys[e] = 0xffffffffu - id_of(e);
        __syncthreads();
        unsigned long long cut_low;
        uint32_t unused;
        bool all_low;  // either way the ties taken are those >= cut_low: ids are distinct
        select_largest(keys, n, [&](uint32_t e) { return keys[e] >> 32 == 0ull; }, at_cut, 32, hist, out, cut_low,
                       unused, all_low);
        last_id = 0xffffffffu - (uint32_t)cut_low;
        for (uint32_t e = threadIdx.x; e < n; e += AF_THREADS)
            if (keys[e] >> 32 == 0ull) keys[e] = cut;
        __syncthreads();
    }
    for (uint32_t e = threadIdx.x; e < n; e += AF_THREADS)
        if (keys[e] > cut || (keys[e] == cut && (!split || id_of(e) <= last_id))) emit(e);
    __syncthreads();  // (hist and out free again)
}

// LM_HEAD task t, a sampled step: its slot gets its rows' top_k penalised logits (their keys and
// ids, in no order). The task's logits are in the arena.
__device__ __noinline__ void lm_candidates(const af_args& a, const af_task& t, uint32_t step, float* sm) {
    const af_sampling& s = *a.samp;
    const uint32_t vocab = a.c.vocab, state = step & 1u;
    const float* logits = a.act + a.c.act_logits + t.row_start;
    uint32_t* hist = reinterpret_cast<uint32_t*>(sm);
    uint32_t* out = hist + 256;
    unsigned long long* keys = reinterpret_cast<unsigned long long*>(sm + AF_SAMPLE_SHARED_FLOATS);
    __syncthreads();  // every row's logit written (lane 0 of each warp), sm free
    for (uint32_t i = threadIdx.x; i < t.row_count; i += AF_THREADS)
        keys[i] = order_key(penalised(s, vocab, state, t.row_start + i, __ldcg(logits + i)));
    if (threadIdx.x == 0) out[3] = 0;
    __syncthreads();
    uint32_t* slot = s.cand + 4 * AF_SAMPLE_K * t.slot;
    // (the host draws in the kernel only where every task has top_k rows or more)
    pick_largest(keys, t.row_count, s.top_k, hist, out, [&](uint32_t i) { return t.row_start + i; },
                 [&](uint32_t i) {
                     const uint32_t at = atomicAdd(out + 3, 1u);
                     *reinterpret_cast<unsigned long long*>(slot + 4 * at) = keys[i];
                     slot[4 * at + 2] = t.row_start + i;
                 });
}

// Warp 0's helpers for the chain over at most 2 x 32 candidates, lane l holding l and l + 32.
// The drawing runs once a step with a cold instruction cache: its loops stay rolled and the
// helpers are calls, so that less code is fetched (the chain 16 KB of SASS with them, not 54).
#define AF_FULL_WARP 0xffffffffu

__device__ __forceinline__ double warp_max(double x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmax(x, __shfl_xor_sync(AF_FULL_WARP, x, off));
    return x;
}

// the largest of v[0..n), every lane the same
__device__ __noinline__ double largest(const double* v, uint32_t n) {
    double top = -INFINITY;
#pragma unroll 1
    for (uint32_t i = threadIdx.x; i < n; i += 32) top = fmax(top, v[i]);
    return warp_max(top);
}

// For i = lane + 32 h of v[0..n): whether v[i] > -inf (live[h]) and its place among those in order
// (place[h]). Returns how many are live.
__device__ __noinline__ uint32_t live_places(const double* v, uint32_t n, bool live[2], uint32_t place[2]) {
    const uint32_t below = (1u << threadIdx.x) - 1u;
    uint32_t total = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t i = threadIdx.x + 32u * h;
        live[h] = i < n && v[i] > -INFINITY;
        const uint32_t mask = __ballot_sync(AF_FULL_WARP, live[h]);
        place[h] = total + __popc(mask & below);
        total += __popc(mask);
    }
    return total;
}

// numpy's sum of a[0..m) (pairwise_sum, m <= 128), every lane the same: fewer than 8 in order from
// 0, else 8 running sums (lanes 0..7) combined in pairs, then the rest in order.
__device__ __noinline__ double numpy_sum(const double* a, uint32_t m) {
    const uint32_t lane = threadIdx.x;
    double res = 0.0;
    if (m < 8) {
        if (lane == 0) {
#pragma unroll 1
            for (uint32_t i = 0; i < m; ++i) res += a[i];
        }
    } else {
        const uint32_t end = m - m % 8;
        double r = 0.0;
        if (lane < 8) {
            r = a[lane];
#pragma unroll 1
            for (uint32_t i = 8 + lane; i < end; i += 8) r += a[i];
        }
        // ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)) gathers in lane 0
        r += __shfl_down_sync(AF_FULL_WARP, r, 1);
        r += __shfl_down_sync(AF_FULL_WARP, r, 2);
        r += __shfl_down_sync(AF_FULL_WARP, r, 4);
        res = r;
        if (lane == 0) {
#pragma unroll 1
            for (uint32_t i = end; i < m; ++i) res += a[i];
        }
    }
    return __shfl_sync(AF_FULL_WARP, res, 0);
}

// sampling._probabilities over the values v[i] > -inf of v[0..n) (warp 0; p[i] = 0 elsewhere):
// all of it shared by the +inf values if any, else exp(v - max) over their numpy sum. `alive`
// (AF_SAMPLE_K) is the work array the live values are gathered into, in order.
__device__ __noinline__ void probabilities(const double* v, uint32_t n, double* p, double* alive) {
    const uint32_t lane = threadIdx.x;
    const double top = largest(v, n);
    if (top == INFINITY) {
        uint32_t inf = 0;
#pragma unroll 1
        for (uint32_t i = lane; i < n; i += 32) inf += v[i] == INFINITY;
        inf = __reduce_add_sync(AF_FULL_WARP, inf);
#pragma unroll 1
        for (uint32_t i = lane; i < n; i += 32) p[i] = v[i] == INFINITY ? 1.0 / (double)inf : 0.0;
        __syncwarp();
        return;
    }
    bool live[2];
    uint32_t place[2];
    const uint32_t m = live_places(v, n, live, place);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t i = lane + 32u * h;
        if (i < n) p[i] = live[h] ? exp(v[i] - top) : 0.0;
        if (live[h]) alive[place[h]] = p[i];
    }
    __syncwarp();
    const double total = numpy_sum(alive, m);
#pragma unroll 1
    for (uint32_t i = lane; i < n; i += 32) p[i] = v[i] > -INFINITY ? p[i] / total : 0.0;
    __syncwarp();
}

// numpy's cumulative sums of a[0..m) (m <= 64, in order; a >= +0, so that starting from 0.0 adds
// nothing), lane l getting those of l and l + 32: the running sum passes down the warp's lanes, so
// the values' loads are not in its chain.
struct af_sums {
    double low, high;
};

__device__ __forceinline__ af_sums warp_cumsum(const double* a, uint32_t m) {
    const uint32_t lane = threadIdx.x;
    const double a0 = lane < m ? a[lane] : 0.0, a1 = lane + 32u < m ? a[lane + 32u] : 0.0;
    af_sums c{0.0, 0.0};
    double sum = 0.0;
#pragma unroll 4
    for (uint32_t r = 0; r < 32; ++r) {
        sum += __shfl_sync(AF_FULL_WARP, a0, r);
        if (lane == r) c.low = sum;
    }
#pragma unroll 4
    for (uint32_t r = 0; r < 32; ++r) {
        sum += __shfl_sync(AF_FULL_WARP, a1, r);
        if (lane == r) c.high = sum;
    }
    return c;
}

// The first index r < m whose sum passes (in every lane), m where none does.
__device__ __forceinline__ uint32_t first_passing(bool low, bool high, uint32_t m) {
    const uint32_t lane = threadIdx.x;
    const uint32_t in_low = __ballot_sync(AF_FULL_WARP, lane < m && low);
    const uint32_t in_high = __ballot_sync(AF_FULL_WARP, lane + 32u < m && high);
    return in_low ? __ffs(in_low) - 1 : in_high ? 32u + __ffs(in_high) - 1 : m;
}

// The chain after top-k over v[0..n), ids ascending (warp 0): top-p, min-p, temperature, the draw
// with u. Returns the index drawn. p, work: AF_SAMPLE_K doubles; rank: AF_SAMPLE_K words.
// Cumulative sums pass down the warp's lanes in order (numpy's cumsum, warp_cumsum); the rest is
// spread over the lanes.
__device__ __noinline__ uint32_t draw_chain(const af_sampling& s, double* v, uint32_t n, float u, double* p, double* work,
                               uint32_t* rank) {
    const uint32_t lane = threadIdx.x;
    if (s.flags & AF_S_TOP_P) {
        probabilities(v, n, p, work);
        // each lane's values lane and lane + 32: their probabilities (-1 where not live) and their
        // places when sorted by probability down, the lower index first among ties
        const uint32_t i0 = lane, i1 = lane + 32u;
        const bool live0 = i0 < n && v[i0] > -INFINITY, live1 = i1 < n && v[i1] > -INFINITY;
        const double p0 = live0 ? p[i0] : -1.0, p1 = live1 ? p[i1] : -1.0;
        // compared as integers: a probability's bits order as it does (>= +0), plus 1 above the
        // values not live (0)
        const unsigned long long k0 = live0 ? __double_as_longlong(p0) + 1ull : 0ull;
        const unsigned long long k1 = live1 ? __double_as_longlong(p1) + 1ull : 0ull;
        uint32_t r0 = 0, r1 = 0;
#pragma unroll 8
        for (uint32_t j = 0; j < 32; ++j) {
            const unsigned long long q0 = __shfl_sync(AF_FULL_WARP, k0, j), q1 = __shfl_sync(AF_FULL_WARP, k1, j);
            r0 += (q0 > k0 || (q0 == k0 && j < i0)) + (q1 > k0);
            r1 += (q0 >= k1) + (q1 > k1 || (q1 == k1 && j < lane));
        }
        // the sorted probabilities; their cumulative sum in order until it reaches top_p
        double* sorted = work;
        if (live0) sorted[r0] = p0;
        if (live1) sorted[r1] = p1;
        const uint32_t n_live = __popc(__ballot_sync(AF_FULL_WARP, live0)) + __popc(__ballot_sync(AF_FULL_WARP, live1));
        __syncwarp();
        // searchsorted(cumsum, top_p, "left") + 1
        const af_sums c = warp_cumsum(sorted, n_live);
        const uint32_t keep = first_passing(c.low >= s.top_p, c.high >= s.top_p, n_live) + 1;
        if (i0 < n && !(live0 && r0 < keep)) v[i0] = -INFINITY;
        if (i1 < n && !(live1 && r1 < keep)) v[i1] = -INFINITY;
        __syncwarp();
    }
    if (s.flags & AF_S_MIN_P) {
        const double top = largest(v, n);
#pragma unroll 1
        for (uint32_t i = lane; i < n; i += 32) {
            const bool keep = isfinite(top) ? v[i] - top >= s.log_min_p : v[i] == top;
            if (!keep) v[i] = -INFINITY;
        }
        __syncwarp();
    }
    if (s.flags & AF_S_TEMPERATURE) {
        const double top = largest(v, n);
        const bool shift = isfinite(top) && top / s.temperature == INFINITY;  // a tiny temperature
#pragma unroll 1
        for (uint32_t i = lane; i < n; i += 32) v[i] = shift ? (v[i] - top) / s.temperature : v[i] / s.temperature;
        __syncwarp();
    }
    probabilities(v, n, p, work);
    // the live values' probabilities in order, their cumulative sums, then the first that passes
    // u * total ("right")
    bool live[2];
    uint32_t place[2];
    const uint32_t m = live_places(v, n, live, place);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (live[h]) {
            work[place[h]] = p[lane + 32u * h];
            rank[place[h]] = lane + 32u * h;
        }
    }
    __syncwarp();
    if (m == 0) return 0u;  // (none left: the host refuses the request)
    const af_sums c = warp_cumsum(work, m);
    const double target = (double)u * __shfl_sync(AF_FULL_WARP, m - 1 < 32u ? c.low : c.high, (m - 1) % 32u);
    const uint32_t at = min(first_passing(c.low > target, c.high > target, m), m - 1);
    const uint32_t index = rank[at];
    __syncwarp();
    return index;
}

// The token step `done` draws: every block the same. Returns it in every thread.
__device__ __noinline__ uint32_t draw_token(const af_args& a, uint32_t done, float* sm) {
    const af_sampling& s = *a.samp;
    const uint32_t k = s.top_k;
    const uint32_t n = k * a.c.lm_parts;  // candidates: every slot holds k
    uint32_t* hist = reinterpret_cast<uint32_t*>(sm);
    uint32_t* out = hist + 256;
    double* value = reinterpret_cast<double*>(sm + 260);  // (unsorted, then by id)
    double* sorted = value + AF_SAMPLE_K;
    double* p = sorted + AF_SAMPLE_K;
    uint32_t* ids = reinterpret_cast<uint32_t*>(p + AF_SAMPLE_K);
    uint32_t* sorted_ids = ids + AF_SAMPLE_K;
    uint32_t* rank = sorted_ids + AF_SAMPLE_K;
    unsigned long long* keys = reinterpret_cast<unsigned long long*>(sm + AF_SAMPLE_SHARED_FLOATS);
    // candidate e: entry e % k of slot e / k, its penalised value's key as its LM_HEAD task made it
    auto entry = [&](uint32_t e) { return s.cand + 4 * (AF_SAMPLE_K * (e / k) + e % k); };
#pragma unroll 8
    for (uint32_t e = threadIdx.x; e < n; e += AF_THREADS)
        keys[e] = __ldcg(reinterpret_cast<const unsigned long long*>(entry(e)));
    if (threadIdx.x == 0) out[3] = 0;
    __syncthreads();
    pick_largest(keys, n, k, hist, out, [&](uint32_t e) { return __ldcg(entry(e) + 2); },
                 [&](uint32_t e) {
                     const uint32_t at = atomicAdd(out + 3, 1u);
                     value[at] = key_value(keys[e]);
                     ids[at] = __ldcg(entry(e) + 2);
                 });
    if (threadIdx.x < k) {  // ids ascending, as top_k leaves them
        uint32_t r = 0;
#pragma unroll 8
        for (uint32_t j = 0; j < k; ++j) r += ids[j] < ids[threadIdx.x];
        sorted[r] = value[threadIdx.x];
        sorted_ids[r] = ids[threadIdx.x];
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        uint32_t index = 0;
        if (s.flags & AF_S_GREEDY) {
#pragma unroll 1
            for (uint32_t i = 1; i < k; ++i)
                if (sorted[i] > sorted[index]) index = i;
        } else {
            index = draw_chain(s, sorted, k, s.u[done - (a.ctl->n_forced - 1)], p, value, rank);
        }
        if (threadIdx.x == 0) out[0] = sorted_ids[index];
    }
    __syncthreads();
    const uint32_t token = out[0];
    __syncthreads();  // out read by all before anything writes sm again
    return token;
}

// After step `done` drew `token` (block 0, one thread): the state the next step reads, (done + 1)
// & 1, which holds that of step done - 1 (at the first drawing step, that of the step itself),
// gets the token step done ran and the one it drew.
__device__ __noinline__ void advance_state(const af_args& a, uint32_t done, uint32_t token) {
    const af_sampling& s = *a.samp;
    const uint32_t vocab = a.c.vocab, first = a.ctl->n_forced - 1;
    uint32_t* win = s.win + ((done + 1) & 1u) * vocab;
    uint32_t* gen = s.gen + ((done + 1) & 1u) * vocab;
    const uint32_t at = s.hist_len + (done - first);  // the drawn token's place in hist
    s.hist[at] = token;
#pragma unroll 1
    for (uint32_t i = done > first ? at - 1 : at; i <= at; ++i) {
        const uint32_t x = __ldcg(s.hist + i);
        win[x] += 1u;
        if (s.last_n && i >= s.last_n) win[__ldcg(s.hist + i - s.last_n)] -= 1u;
        if (i >= s.n_prompt) gen[x] += 1u;
    }
}

