// EXPERIMENT: the previous attention_decode.wgsl, per-head values in private arrays.
// Grouped-query attention of one decode token over the K/V cache, split along the cache
// (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html). Workgroup (split,
// kv head) serves every query head of the K/V group, so each K and V row is read once for the group,
// over positions [split * S.split_len, (split + 1) * S.split_len) that the query sees (pos - j <
// window on sliding-window layers), in blocks of BLOCK positions with an online softmax.
// It first does rope.wgsl's work for what it needs: bias, QK-norm and RoPE of its query heads and
// of the new key; the split holding the new position writes K and V to the cache and uses them from
// workgroup memory itself, so no workgroup waits for its own write. Every load that does not depend
// on another (raw heads, biases, angles) is issued before the first barrier.
// Scores: an invocation per position (a K row as HD / 4 vec4); the block's maxima and sums go across
// subgroups (lanes_{REDUCE}.wgsl), then once through workgroup memory. P V: invocation (slice, dim
// quad) takes every SLICES-th position, then the slices are added. With one split the workgroup
// writes the normalized output itself and the runtime skips attention_merge.wgsl.

#include "rope_params.wgsl"

#include "attention_params.wgsl"

#include "step.wgsl"

@group(0) @binding(0) var<storage, read> QKV: array<f32>;            // (n_q + 2 n_kv,) raw projections
@group(0) @binding(1) var<storage, read> W: array<u32>;              // the layer: QK-norm weights, biases
@group(0) @binding(2) var<storage, read> T: array<f32>;              // RoPE angle table
@group(0) @binding(3) var<storage, read_write> KV: array<vec4<f32>>; // K then V: (n_head_kv, n_ctx, head_dim / 4)
@group(0) @binding(4) var<storage, read_write> PART: array<f32>;     // (n_head, splits, head_dim + 2)
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;      // (n_head * head_dim,), one split only
@group(0) @binding(6) var<uniform> P: Params;
@group(0) @binding(7) var<uniform> R: RopeParams;
@group(0) @binding(8) var<uniform> S: Step;

const WG: u32 = 128u;
const GROUP: u32 = {ATTN_GROUP}u;     // query heads per K/V head
const HD: u32 = {ATTN_HEAD_DIM}u;     // head_dim, a multiple of 4, at most 256
const BLOCK: u32 = {ATTN_BLOCK}u;     // positions whose scores are held at once: WG or a multiple
const HD4: u32 = HD / 4u;
const SLICES: u32 = WG / HD4;         // P V: invocations per dim quad
const FRESH: u32 = GROUP + 1u;        // heads made ready here: the group's queries, then the key
const PAIRS: u32 = (FRESH * HD / 2u + WG - 1u) / WG;  // rotated pairs per invocation, at most
const HEADS_PASS: u32 = 4u;           // heads whose P V slices are added at once
const EMPTY: f32 = -1.0e30;           // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs
const MAX_SUBGROUPS: u32 = 32u;       // WG / the narrowest subgroup (4 lanes)

#include "lanes_{REDUCE}.wgsl"

var<workgroup> fresh: array<f32, FRESH * HD>;              // (FRESH, HD): heads at the new position
var<workgroup> queries: array<vec4<f32>, GROUP * HD4>;     // (head, dim quad): the rotated queries, pre-scaled
var<workgroup> fresh_v: array<vec4<f32>, HD4>;             // the new value (split holding pos)
var<workgroup> row_scale: array<f32, FRESH>;               // 1 / rms of each fresh head (QK-norm)
var<workgroup> probs: array<f32, GROUP * BLOCK>;           // (head, position of the block)
var<workgroup> xchg: array<f32, MAX_SUBGROUPS * GROUP>;    // (subgroup, head): a block's maxima or sums
var<workgroup> part_o: array<vec4<f32>, SLICES * HEADS_PASS * HD4>;  // (slice, head of the pass, dim quad)

// per head, the maximum (is_max) or the sum of v over the workgroup
fn heads_total(v: array<f32, GROUP>, lid: u32, is_max: bool) -> array<f32, GROUP> {
    let lanes = lane_count();
    let n_sub = WG / lanes;
    var out: array<f32, GROUP>;
    for (var g = 0u; g < GROUP; g++) {
        if (is_max) {
            out[g] = lanes_max4(vec4<f32>(v[g]), lid).x;
        } else {
            out[g] = lanes_sum1(v[g], lid);
        }
    }
    workgroupBarrier();  // the previous exchange has been read
    if (lid % lanes == 0u) {
        for (var g = 0u; g < GROUP; g++) {
            xchg[(lid / lanes) * GROUP + g] = out[g];
        }
    }
    workgroupBarrier();
    for (var g = 0u; g < GROUP; g++) {
        var total = select(0.0, EMPTY, is_max);
        for (var s = 0u; s < n_sub; s++) {
            let x = xchg[s * GROUP + g];
            total = select(total + x, max(total, x), is_max);
        }
        out[g] = total;
    }
    return out;
}

// The group's query heads and the K/V head's key at position pos, with bias, QK-norm and RoPE
// applied as rope.wgsl does, into `fresh`; the split holding pos writes K and V to the cache.
fn rope_fresh(lid: u32, kv_head: u32, pos: u32, holds_pos: bool) {
    let n_q = R.n_head * HD;
    let q_src = kv_head * GROUP * HD;
    let k_src = n_q + kv_head * HD;
    let v_src = k_src + R.n_head_kv * HD;
    let half = R.rope_dim / 2u;
    var angles: array<vec2<f32>, PAIRS>;   // cos, sin of my pairs, loaded with the heads
    for (var i = 0u; i < PAIRS; i++) {
        let e = lid + i * WG;
        if (e < FRESH * half) {
            let at = R.table + (pos * half + e % half) * 2u;
            angles[i] = vec2<f32>(T[at], T[at + 1u]);
        }
    }
    for (var e = lid; e < FRESH * HD; e += WG) {
        let is_k = e >= GROUP * HD;
        let d = e % HD;
        var v = QKV[select(q_src + e, k_src + d, is_k)];
        if (R.qkv_bias == 1u) {
            v += bitcast<f32>(W[select(R.q_bias + q_src + e, R.k_bias + kv_head * HD + d, is_k)]);
        }
        fresh[e] = v;
    }
    if (holds_pos && lid < HD4) {
        var v = vec4<f32>(QKV[v_src + 4u * lid], QKV[v_src + 4u * lid + 1u], QKV[v_src + 4u * lid + 2u],
                          QKV[v_src + 4u * lid + 3u]);
        if (R.qkv_bias == 1u) {
            let b = R.v_bias + kv_head * HD + 4u * lid;
            v += vec4<f32>(bitcast<f32>(W[b]), bitcast<f32>(W[b + 1u]), bitcast<f32>(W[b + 2u]), bitcast<f32>(W[b + 3u]));
        }
        fresh_v[lid] = v;
        KV[R.n_head_kv * R.n_ctx * HD4 + (kv_head * R.n_ctx + pos) * HD4 + lid] = v;
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
    for (var i = 0u; i < PAIRS; i++) {
        let e = lid + i * WG;
        if (e < FRESH * half) {
            let p = (e / half) * HD + rope_pair(e % half, R.neox, R.rope_dim);
            let a = fresh[p.x];
            let b = fresh[p.y];
            fresh[p.x] = a * angles[i].x - b * angles[i].y;  // every invocation writes only its own pairs
            fresh[p.y] = a * angles[i].y + b * angles[i].x;
        }
    }
    workgroupBarrier();
    if (holds_pos && lid < HD4) {
        let k = GROUP * HD + 4u * lid;
        KV[(kv_head * R.n_ctx + pos) * HD4 + lid] = vec4<f32>(fresh[k], fresh[k + 1u], fresh[k + 2u], fresh[k + 3u]);
    }
    for (var i = lid; i < GROUP * HD4; i += WG) {
        queries[i] = vec4<f32>(fresh[4u * i], fresh[4u * i + 1u], fresh[4u * i + 2u], fresh[4u * i + 3u]) * P.scale;
    }
    workgroupBarrier();
}

fn key(kv_head: u32, j: u32, pos: u32, i: u32) -> vec4<f32> {
    if (j == pos) {  // the new key: this workgroup made it
        let at = GROUP * HD + 4u * i;
        return vec4<f32>(fresh[at], fresh[at + 1u], fresh[at + 2u], fresh[at + 3u]);
    }
    return KV[(kv_head * P.n_ctx + j) * HD4 + i];
}

fn value(kv_head: u32, j: u32, pos: u32, dq: u32) -> vec4<f32> {
    if (j == pos) {
        return fresh_v[dq];
    }
    return KV[(P.n_head_kv + kv_head) * P.n_ctx * HD4 + j * HD4 + dq];
}

@compute @workgroup_size(128)
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

    let dq = lid % HD4;          // P V: my dim quad and slice of positions
    let slice = lid / HD4;
    var m: array<f32, GROUP>;
    var l: array<f32, GROUP>;
    var acc: array<vec4<f32>, GROUP>;
    for (var g = 0u; g < GROUP; g++) {
        m[g] = EMPTY;
    }
    for (var b = begin; b < end; b += BLOCK) {
        let n = min(BLOCK, end - b);
        // scores of my positions, and their maxima per head
        var top: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            top[g] = EMPTY;  // explicitly: Naga zeroes a loop's `var` once, not on every iteration
        }
        for (var j = lid; j < n; j += WG) {
            var s: array<f32, GROUP>;
            for (var g = 0u; g < GROUP; g++) {
                s[g] = 0.0;
            }
            for (var i = 0u; i < HD4; i++) {
                let k = key(kv_head, b + j, pos, i);
                for (var g = 0u; g < GROUP; g++) {
                    s[g] += dot(queries[g * HD4 + i], k);
                }
            }
            for (var g = 0u; g < GROUP; g++) {
                var v = s[g];
                if (P.softcap > 0.0) {  // tanh saturates long before 20: clamping avoids inf / inf
                    v = P.softcap * tanh(clamp(v / P.softcap, -20.0, 20.0));
                }
                probs[g * BLOCK + j] = v;
                top[g] = max(top[g], v);
            }
        }
        let block_max = heads_total(top, lid, true);
        var sums: array<f32, GROUP>;
        var correction: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            let new_m = max(m[g], block_max[g]);
            correction[g] = exp(m[g] - new_m);
            m[g] = new_m;
            sums[g] = 0.0;
        }
        for (var j = lid; j < n; j += WG) {
            for (var g = 0u; g < GROUP; g++) {
                let p = exp(probs[g * BLOCK + j] - m[g]);
                probs[g * BLOCK + j] = p;
                sums[g] += p;
            }
        }
        let block_sum = heads_total(sums, lid, false);  // its barriers also publish `probs`
        for (var g = 0u; g < GROUP; g++) {
            l[g] = l[g] * correction[g] + block_sum[g];
            acc[g] *= correction[g];
        }
        if (slice < SLICES) {
            // two values loaded before they are used: the loop is bound by load latency, not work
            var j = slice;
            for (; j + SLICES < n; j += 2u * SLICES) {
                let v0 = value(kv_head, b + j, pos, dq);
                let v1 = value(kv_head, b + j + SLICES, pos, dq);
                for (var g = 0u; g < GROUP; g++) {
                    acc[g] += probs[g * BLOCK + j] * v0 + probs[g * BLOCK + j + SLICES] * v1;
                }
            }
            if (j < n) {
                let v = value(kv_head, b + j, pos, dq);
                for (var g = 0u; g < GROUP; g++) {
                    acc[g] += probs[g * BLOCK + j] * v;
                }
            }
        }
        workgroupBarrier();  // `probs` is overwritten by the next block
    }
    // add the slices, HEADS_PASS heads at a time, and write
    let n_splits = (S.n_past + 1u + S.split_len - 1u) / S.split_len;
    for (var g0 = 0u; g0 < GROUP; g0 += HEADS_PASS) {
        workgroupBarrier();
        if (slice < SLICES) {
            for (var g = g0; g < min(GROUP, g0 + HEADS_PASS); g++) {
                part_o[(slice * HEADS_PASS + g - g0) * HD4 + dq] = acc[g];
            }
        }
        workgroupBarrier();
        for (var i = lid; i < HEADS_PASS * HD4; i += WG) {
            let g = g0 + i / HD4;
            if (g < GROUP) {
                var o = vec4<f32>(0.0);
                for (var s = 0u; s < SLICES; s++) {
                    o += part_o[s * HEADS_PASS * HD4 + i];
                }
                let h = kv_head * GROUP + g;
                let out = (h * n_splits + split) * (HD + 2u);
                let d = 4u * (i % HD4);
                for (var c = 0u; c < 4u; c++) {
                    PART[out + d + c] = o[c];
                    if (n_splits == 1u) {
                        OUT[h * HD + d + c] = o[c] / l[g];
                    }
                }
                if (i % HD4 == 0u) {
                    PART[out + HD] = m[g];
                    PART[out + HD + 1u] = l[g];
                }
            }
        }
    }
}
