// Grouped-query attention of one decode token over the K/V cache, split along the cache
// (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html). Workgroup (split,
// kv head) serves every query head of the K/V group, so each K and V row is read once for the group,
// over positions [split * S.split_len, (split + 1) * S.split_len) that the query sees (pos - j <
// window on sliding-window layers), in blocks of BLOCK positions with an online softmax. It first
// does rope.wgsl's work for what it needs: bias, QK-norm and RoPE of its query heads and of the new
// key, and the split holding the new position writes K and V there before reading them.
// Scores: an invocation per position (a K row as HD / 4 vec4), kept in workgroup memory; the
// maxima and sums of a block go through one exchange each. P V: invocation (slice, dim quad) takes
// every SLICES-th position of the block, then the slices are added. With one split the workgroup
// writes the normalized output itself and the runtime skips attention_merge.wgsl.

#include "rope_params.wgsl"

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    n_ctx: u32,        // cache capacity in positions
    window: u32,       // 0: the whole context
    scale: f32,        // 1 / sqrt(head_dim)
    qkv_stride: u32,   // floats per token in QKV
    softcap: f32,      // > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2); 0: off
}

struct Step {
    n_past: u32,
    n_tokens: u32,
    lm_first: u32,
    split_len: u32,
}

@group(0) @binding(0) var<storage, read> QKV: array<f32>;            // (n_q + 2 n_kv,) raw projections
@group(0) @binding(1) var<storage, read> W: array<u32>;              // the layer: QK-norm weights, biases
@group(0) @binding(2) var<storage, read> T: array<f32>;              // RoPE angle table
@group(0) @binding(3) var<storage, read_write> KV: array<vec4<f32>>; // K then V: (n_head_kv, n_ctx, head_dim / 4)
@group(0) @binding(4) var<storage, read_write> PART: array<f32>;     // (n_head, splits, head_dim + 2)
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;      // (n_head * head_dim,), one split only
@group(0) @binding(6) var<uniform> P: Params;
@group(0) @binding(7) var<uniform> R: RopeParams;
@group(0) @binding(8) var<uniform> S: Step;

const WG: u32 = 64u;
const GROUP: u32 = {ATTN_GROUP}u;     // query heads per K/V head
const HD: u32 = {ATTN_HEAD_DIM}u;     // head_dim, a multiple of 4, at most 256
const BLOCK: u32 = {ATTN_BLOCK}u;     // positions whose scores are held at once
const HD4: u32 = HD / 4u;
const SLICES: u32 = max(1u, WG / HD4);  // P V: invocations per dim quad
const FRESH: u32 = GROUP + 1u;        // heads made ready here: the group's queries, then the key
const EMPTY: f32 = -1.0e30;           // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs

var<workgroup> q: array<vec4<f32>, GROUP * HD4>;           // (head, dim quad), pre-scaled
var<workgroup> fresh: array<f32, FRESH * HD>;              // (FRESH, HD): heads at the new position
var<workgroup> row_scale: array<f32, FRESH>;               // 1 / rms of each fresh head (QK-norm)
var<workgroup> probs: array<f32, GROUP * BLOCK>;           // (head, position of the block)
var<workgroup> parts: array<f32, WG * GROUP>;              // (invocation, head): maxima, then sums
var<workgroup> head_m: array<f32, GROUP>;                  // running max per head
var<workgroup> head_l: array<f32, GROUP>;                  // running sum per head
var<workgroup> head_c: array<f32, GROUP>;                  // this block's correction of the old sums
var<workgroup> part_o: array<vec4<f32>, SLICES * GROUP * HD4>;  // (slice, head, dim quad)

// The group's query heads and the K/V head's key at position pos, with bias, QK-norm and RoPE
// applied as rope.wgsl does, into `fresh`; the split holding pos writes K and V to the cache.
fn rope_fresh(lid: u32, kv_head: u32, pos: u32, holds_pos: bool) {
    let n_q = R.n_head * HD;
    let q_src = kv_head * GROUP * HD;
    let k_src = n_q + kv_head * HD;
    for (var e = lid; e < FRESH * HD; e += WG) {
        let is_k = e >= GROUP * HD;
        let d = e % HD;
        var v = QKV[select(q_src + e, k_src + d, is_k)];
        if (R.qkv_bias == 1u) {
            v += bitcast<f32>(W[select(R.q_bias + q_src + e, R.k_bias + kv_head * HD + d, is_k)]);
        }
        fresh[e] = v;
    }
    workgroupBarrier();
    if (R.qk_norm == 1u) {
        for (var r = lid; r < FRESH; r += WG) {
            var sum = 0.0;
            for (var d = 0u; d < HD; d++) {
                sum += fresh[r * HD + d] * fresh[r * HD + d];
            }
            row_scale[r] = inverseSqrt(sum / f32(HD) + R.eps);
        }
        workgroupBarrier();
        for (var e = lid; e < FRESH * HD; e += WG) {
            let r = e / HD;
            let w = select(R.q_norm_w, R.k_norm_w, r == GROUP) + e % HD;
            fresh[e] = fresh[e] * row_scale[r] * bitcast<f32>(W[w]);
        }
        workgroupBarrier();
    }
    let half = R.rope_dim / 2u;
    for (var e = lid; e < FRESH * half; e += WG) {
        let at = R.table + (pos * half + e % half) * 2u;
        let c = T[at];
        let s = T[at + 1u];
        let p = (e / half) * HD + rope_pair(e % half, R.neox, R.rope_dim);
        let a = fresh[p.x];
        let b = fresh[p.y];
        fresh[p.x] = a * c - b * s;  // every invocation writes only its own pairs
        fresh[p.y] = a * s + b * c;
    }
    workgroupBarrier();
    if (holds_pos) {
        let cache = (kv_head * R.n_ctx + pos) * HD4;
        let v_cache = R.n_head_kv * R.n_ctx * HD4 + cache;
        let v_src = k_src + R.n_head_kv * HD;
        for (var i = lid; i < HD4; i += WG) {
            let k = GROUP * HD + 4u * i;
            KV[cache + i] = vec4<f32>(fresh[k], fresh[k + 1u], fresh[k + 2u], fresh[k + 3u]);
            var v = vec4<f32>(QKV[v_src + 4u * i], QKV[v_src + 4u * i + 1u], QKV[v_src + 4u * i + 2u],
                              QKV[v_src + 4u * i + 3u]);
            if (R.qkv_bias == 1u) {
                let b = R.v_bias + kv_head * HD + 4u * i;
                v += vec4<f32>(bitcast<f32>(W[b]), bitcast<f32>(W[b + 1u]), bitcast<f32>(W[b + 2u]),
                               bitcast<f32>(W[b + 3u]));
            }
            KV[v_cache + i] = v;
        }
    }
    for (var i = lid; i < GROUP * HD4; i += WG) {
        let at = 4u * i;
        q[i] = vec4<f32>(fresh[at], fresh[at + 1u], fresh[at + 2u], fresh[at + 3u]) * P.scale;
    }
    storageBarrier();  // the cache rows written above are read below by other invocations
    workgroupBarrier();
}

// The scores of positions [b, b + n) for every head into `probs`; returns my maxima per head.
fn scores(lid: u32, kv_head: u32, b: u32, n: u32) -> array<f32, GROUP> {
    var top: array<f32, GROUP>;
    for (var g = 0u; g < GROUP; g++) {
        top[g] = EMPTY;
    }
    let k_base = kv_head * P.n_ctx * HD4;
    for (var j = lid; j < n; j += WG) {
        let row = k_base + (b + j) * HD4;
        var acc: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            acc[g] = 0.0;  // explicitly: Naga zeroes a loop's `var` once, not on every iteration
        }
        for (var i = 0u; i < HD4; i++) {
            let k = KV[row + i];
            for (var g = 0u; g < GROUP; g++) {
                acc[g] += dot(q[g * HD4 + i], k);
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            var s = acc[g];
            if (P.softcap > 0.0) {  // tanh saturates long before 20: clamping avoids inf / inf
                s = P.softcap * tanh(clamp(s / P.softcap, -20.0, 20.0));
            }
            probs[g * BLOCK + j] = s;
            top[g] = max(top[g], s);
        }
    }
    return top;
}

// head g's total of parts[.][g] over the workgroup: the max, or the sum
fn fold(g: u32, is_max: bool) -> f32 {
    var total = select(0.0, EMPTY, is_max);
    for (var i = 0u; i < WG; i++) {
        let v = parts[i * GROUP + g];
        total = select(total + v, max(total, v), is_max);
    }
    return total;
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let split = wid.x;
    let kv_head = wid.y;
    let pos = S.n_past;
    var lo = 0u;
    if (P.window > 0u && pos + 1u > P.window) {
        lo = pos + 1u - P.window;
    }
    let begin = max(lo, split * S.split_len);
    let end = min(pos + 1u, (split + 1u) * S.split_len);
    rope_fresh(lid, kv_head, pos, split * S.split_len <= pos && pos < (split + 1u) * S.split_len);
    if (lid < GROUP) {
        head_m[lid] = EMPTY;
        head_l[lid] = 0.0;
    }

    let dq = lid % HD4;          // P V: my dim quad and slice of positions
    let slice = lid / HD4;
    let v_base = (P.n_head_kv + kv_head) * P.n_ctx * HD4;
    var acc: array<vec4<f32>, GROUP>;
    for (var b = begin; b < end; b += BLOCK) {
        let n = min(BLOCK, end - b);
        let top = scores(lid, kv_head, b, n);
        for (var g = 0u; g < GROUP; g++) {
            parts[lid * GROUP + g] = top[g];
        }
        workgroupBarrier();
        if (lid < GROUP) {
            let new_m = max(head_m[lid], fold(lid, true));
            head_c[lid] = exp(head_m[lid] - new_m);
            head_m[lid] = new_m;
        }
        workgroupBarrier();
        var sums: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            sums[g] = 0.0;
        }
        for (var j = lid; j < n; j += WG) {
            for (var g = 0u; g < GROUP; g++) {
                let p = exp(probs[g * BLOCK + j] - head_m[g]);
                probs[g * BLOCK + j] = p;
                sums[g] += p;
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            parts[lid * GROUP + g] = sums[g];
        }
        workgroupBarrier();
        if (lid < GROUP) {
            head_l[lid] = head_l[lid] * head_c[lid] + fold(lid, false);
        }
        if (slice < SLICES) {
            for (var g = 0u; g < GROUP; g++) {
                acc[g] *= head_c[g];
            }
            for (var j = slice; j < n; j += SLICES) {
                let v = KV[v_base + (b + j) * HD4 + dq];
                for (var g = 0u; g < GROUP; g++) {
                    acc[g] += probs[g * BLOCK + j] * v;
                }
            }
        }
        workgroupBarrier();
    }
    if (slice < SLICES) {
        for (var g = 0u; g < GROUP; g++) {
            part_o[(slice * GROUP + g) * HD4 + dq] = acc[g];
        }
    }
    workgroupBarrier();
    let n_splits = (S.n_past + 1u + S.split_len - 1u) / S.split_len;
    for (var i = lid; i < GROUP * HD4; i += WG) {
        let g = i / HD4;
        var o = vec4<f32>(0.0);
        for (var s = 0u; s < SLICES; s++) {
            o += part_o[s * GROUP * HD4 + i];
        }
        let h = kv_head * GROUP + g;
        let out = (h * n_splits + split) * (HD + 2u);
        let d = 4u * (i % HD4);
        for (var c = 0u; c < 4u; c++) {
            PART[out + d + c] = o[c];
            if (n_splits == 1u) {
                OUT[h * HD + d + c] = o[c] / head_l[g];
            }
        }
        if (i % HD4 == 0u) {
            PART[out + HD] = head_m[g];
            PART[out + HD + 1u] = head_l[g];
        }
    }
}
