// A sampled token's candidates: the logits after the penalties, reduced to every token above a
// threshold chosen so that at least P.want tokens pass, with the log-sum-exp of the whole vocabulary.
// draw.wgsl then picks the token from those few, and the host checks it with its own sampler chain
// (airframe/gpu/candidates.py). With P.masked only the tokens whose bit is set in ALLOWED (a
// grammar's mask) count: the others are neither candidates nor in the log-sum-exp, as if their
// logits were -inf, the way the host's sampler masks them. Four dispatches of this program, one
// per {CANDIDATES_STAGE}:
//   1 penalties: entry j of PEN (a token id, its logit bias, whether it is in the repetition window,
//     its count among the generated tokens) rewrites that token's logit in place; the logit it had
//     goes to OUT.raw[j], so the host can recompute every step in float64. With P.pending the token
//     in TOKENS[row] (drawn for this forward, not yet known to the host; row = first / n, the logits
//     row of a decode batch) counts once more as
//     generated and is in the window: its table entry is changed, or it gets entry n_pen.
//   2 histogram: workgroup g counts its PER logits by the top BIN_BITS bits of their order key and
//     writes their maximum and sum of exp (PART[g]), noting any NaN or infinity.
//   3 threshold: one workgroup finds the highest bin at which the count from the top reaches P.want,
//     combines PART into the log-sum-exp, and clears the histogram for the next token.
//   4 gather: every logit whose key is at least the threshold is appended to OUT.cand (in no order).

struct Params {
    n: u32,                // logits (the vocabulary size)
    n_groups: u32,         // stage 2 and 4 workgroups: ceil(n / PER)
    n_pen: u32,            // entries of PEN this token
    want: u32,             // candidates at least (unless the vocabulary is smaller)
    repeat_penalty: f32,
    presence: f32,
    frequency: f32,
    pending: u32,          // 1: add TOKENS[0] to the penalties as a generated token
    masked: u32,           // 1: only the tokens set in ALLOWED count
    first: u32,            // LOGITS index of logit 0: the row of a decode batch
}

#include "candidates_out.wgsl"

#include "order_key.wgsl"

@group(0) @binding(0) var<storage, read_write> LOGITS: array<f32>;           // (rows, n): row first / n
@group(0) @binding(1) var<storage, read> PEN: array<vec4<u32>>;              // (PEN_MAX,) id, bias bits, in window, count
@group(0) @binding(2) var<storage, read> ALLOWED: array<u32>;               // (ceil(n / 32),) bit i % 32 of word i / 32
@group(0) @binding(3) var<storage, read_write> HIST: array<atomic<u32>>;     // (BINS,) zero between tokens
@group(0) @binding(4) var<storage, read_write> PART: array<vec4<f32>>;       // (n_groups,) max, sum of exp, non-finite
@group(0) @binding(5) var<storage, read_write> OUT: Out;
@group(0) @binding(6) var<uniform> P: Params;
@group(0) @binding(7) var<storage, read> TOKENS: array<u32>;                 // [row]: the token this forward ran

const STAGE: u32 = {CANDIDATES_STAGE}u;
const WG: u32 = 256u;
const ITEMS: u32 = 8u;              // logits per invocation in stages 2 and 4
const PER: u32 = 2048u;             // logits per workgroup: WG * ITEMS
const BIN_BITS: u32 = 12u;
const BINS: u32 = 4096u;            // 1 << BIN_BITS
const BINS_PER_LANE: u32 = 16u;     // BINS / WG
const LOWEST: f32 = -3.4e38;      // below every finite logit; WGSL may assume no infinities

#include "workgroup_reduce.wgsl"

var<workgroup> local_hist: array<atomic<u32>, BINS>;
var<workgroup> running: array<u32, WG>;

fn finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7F800000u) != 0x7F800000u;
}

fn allowed(i: u32) -> bool {
    return P.masked == 0u || ((ALLOWED[i >> 5u] >> (i & 31u)) & 1u) != 0u;
}

// whether token t has an entry in PEN (whose ids ascend)
fn in_table(t: u32) -> bool {
    var lo = 0u;
    var hi = P.n_pen;
    while (lo < hi) {
        let mid = (lo + hi) / 2u;
        let id = PEN[mid].x;
        if (id == t) {
            return true;
        }
        if (id < t) {
            lo = mid + 1u;
        } else {
            hi = mid;
        }
    }
    return false;
}

fn penalise(lid: u32, wid: u32) {
    let j = wid * WG + lid;
    let pend = TOKENS[P.first / P.n];
    var e: vec4<u32>;
    if (j < P.n_pen) {
        e = PEN[j];
        if (P.pending == 1u && e.x == pend) {
            e = vec4<u32>(e.x, e.y, 1u, e.w + 1u);
        }
    } else if (j == P.n_pen && P.pending == 1u && !in_table(pend)) {
        e = vec4<u32>(pend, 0u, 1u, 1u);
    } else {
        return;
    }
    let raw = LOGITS[P.first + e.x];
    OUT.raw[j] = raw;
    var v = raw + bitcast<f32>(e.y);
    if (e.z != 0u) {
        v = select(v * P.repeat_penalty, v / P.repeat_penalty, v > 0.0);
    }
    v -= P.frequency * f32(e.w) + select(0.0, P.presence, e.w > 0u);
    LOGITS[P.first + e.x] = v;
}

fn histogram(lid: u32, wid: u32) {
    for (var b = lid; b < BINS; b += WG) {
        atomicStore(&local_hist[b], 0u);
    }
    workgroupBarrier();
    var values: array<f32, ITEMS>;
    var live = 0u;  // bit k: values[k] is a finite logit
    var top = LOWEST;
    var bad = 0.0;
    let first = wid * PER;
    for (var k = 0u; k < ITEMS; k++) {
        let i = first + k * WG + lid;
        if (i < P.n) {
            let v = LOGITS[P.first + i];
            if (!finite(v)) {
                bad = 1.0;  // masked or not: the host path reports it
            } else if (allowed(i)) {
                atomicAdd(&local_hist[order_key(v) >> (32u - BIN_BITS)], 1u);
                values[k] = v;
                live |= 1u << k;
                top = max(top, v);
            }
        }
    }
    let group_max = workgroup_reduce(top, lid, true);
    var sum = 0.0;
    for (var k = 0u; k < ITEMS; k++) {
        if ((live & (1u << k)) != 0u) {
            sum += exp(values[k] - group_max);
        }
    }
    let group_sum = workgroup_sum(sum, lid);
    let group_bad = workgroup_reduce(bad, lid, true);
    for (var b = lid; b < BINS; b += WG) {
        let c = atomicLoad(&local_hist[b]);
        if (c != 0u) {
            atomicAdd(&HIST[b], c);
        }
    }
    if (lid == 0u) {
        PART[wid] = vec4<f32>(group_max, group_sum, group_bad, 0.0);
    }
}

fn threshold(lid: u32) {
    var top = LOWEST;
    var bad = 0.0;
    for (var g = lid; g < P.n_groups; g += WG) {
        top = max(top, PART[g].x);
        bad = max(bad, PART[g].z);
    }
    let m = workgroup_reduce(top, lid, true);
    var sum = 0.0;
    for (var g = lid; g < P.n_groups; g += WG) {
        let part = PART[g];
        if (part.y > 0.0) {
            sum += part.y * exp(part.x - m);
        }
    }
    let total_sum = workgroup_sum(sum, lid);
    let any_bad = workgroup_reduce(bad, lid, true);

    // lane t holds bins BINS - 1 - (t * BINS_PER_LANE + j): lane 0 the highest
    var counts: array<u32, BINS_PER_LANE>;
    var mine = 0u;
    for (var j = 0u; j < BINS_PER_LANE; j++) {
        let b = BINS - 1u - (lid * BINS_PER_LANE + j);
        counts[j] = atomicLoad(&HIST[b]);
        mine += counts[j];
        atomicStore(&HIST[b], 0u);
    }
    running[lid] = mine;
    workgroupBarrier();
    for (var offset = 1u; offset < WG; offset *= 2u) {  // inclusive prefix sum over the lanes
        var v = running[lid];
        if (lid >= offset) {
            v += running[lid - offset];
        }
        workgroupBarrier();
        running[lid] = v;
        workgroupBarrier();
    }
    let through = running[lid];
    let before = through - mine;
    if (before < P.want && through >= P.want) {
        var c = before;
        for (var j = 0u; j < BINS_PER_LANE; j++) {
            c += counts[j];
            if (c >= P.want) {
                OUT.threshold = (BINS - 1u - (lid * BINS_PER_LANE + j)) << (32u - BIN_BITS);
                break;
            }
        }
    }
    if (lid == WG - 1u && through < P.want) {
        OUT.threshold = 0u;  // fewer logits than wanted: all of them
    }
    if (lid == 0u) {
        atomicStore(&OUT.count, 0u);
        OUT.non_finite = select(0u, 1u, any_bad > 0.0);
        OUT.max_logit = m;
        OUT.log_sum_exp = m + log(total_sum);
    }
}

fn gather(lid: u32, wid: u32) {
    let cut = OUT.threshold;
    let first = wid * PER;
    for (var k = 0u; k < ITEMS; k++) {
        let i = first + k * WG + lid;
        if (i < P.n) {
            let v = LOGITS[P.first + i];
            if (order_key(v) >= cut && allowed(i)) {
                let j = atomicAdd(&OUT.count, 1u);
                if (j < CAP) {
                    OUT.cand[j] = vec2<u32>(i, bitcast<u32>(v));
                }
            }
        }
    }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    switch STAGE {
        case 1u: { penalise(lid3.x, wid.x); }
        case 2u: { histogram(lid3.x, wid.x); }
        case 3u: { threshold(lid3.x); }
        default: { gather(lid3.x, wid.x); }
    }
}
