// Causal grouped-query attention of a chunk's queries over the K/V cache, split along the cache
// (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html). Workgroup (split,
// kv head, token) serves every query head of its K/V group, so each K and V row is read once for
// the group: it covers positions [split * S.split_len, (split + 1) * S.split_len) that the query
// sees (j <= pos, and pos - j < window on sliding-window layers), runs an online softmax over blocks
// of 64 positions and writes, per query head, its unnormalized output with its running max and sum;
// attention_merge.wgsl combines the splits. When there is a single split (short contexts) the
// workgroup also writes the normalized output to OUT itself, exactly what the merge would write
// (acc / l), and the runtime skips the merge dispatch. Serves decode and prefill chunks alike.
// ATTN_ROPE = 1 (decode, one token): QKV holds the raw projections and each workgroup does
// rope.wgsl's work for what it needs: bias, QK-norm and RoPE of its query heads and of the new key,
// and the split holding the new position writes K and V there before reading them; the runtime
// then skips the rope dispatch. (Prefill cannot: other tokens' workgroups read the chunk's keys.)

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

@group(0) @binding(0) var<storage, read> QKV: array<f32>;            // (tokens, n_q + 2 n_kv); Q rotated unless ATTN_ROPE
@group(0) @binding(1) var<storage, read> W: array<u32>;              // the layer: QK-norm weights, biases (ATTN_ROPE)
@group(0) @binding(2) var<storage, read> T: array<f32>;              // RoPE angle table (ATTN_ROPE)
@group(0) @binding(3) var<storage, read_write> KV: array<vec4<f32>>; // K then V: (n_head_kv, n_ctx, head_dim / 4)
@group(0) @binding(4) var<storage, read_write> PART: array<f32>;     // (tokens, n_head, splits, head_dim + 2)
@group(0) @binding(5) var<storage, read_write> OUT: array<f32>;      // (tokens, n_head * head_dim), one split only
@group(0) @binding(6) var<uniform> P: Params;
@group(0) @binding(7) var<uniform> R: RopeParams;                    // ATTN_ROPE only
@group(0) @binding(8) var<uniform> S: Step;

const WG: u32 = 64u;
// The model's shape is fixed per pipeline (kernels.attention_defines), so every per-head loop has a
// constant trip count and the per-head arrays below can live in registers.
const GROUP: u32 = {ATTN_GROUP}u;     // query heads per K/V head (P.n_head / P.n_head_kv)
const HD: u32 = {ATTN_HEAD_DIM}u;     // head_dim (P.head_dim), a multiple of 4
const DIMS: u32 = {ATTN_DIMS}u;       // head dims per invocation and query head: ceil(HD / WG)
const EMPTY: f32 = -1.0e30;   // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs
const ROPE: u32 = {ATTN_ROPE}u;       // 1: rotate Q and K here and write the new K/V (decode)
const FRESH: u32 = GROUP + 1u;        // heads made ready by ATTN_ROPE: the group's queries, then the key

var<workgroup> q: array<f32, {ATTN_Q}>;                  // (GROUP, HD), pre-scaled
var<workgroup> fresh: array<f32, FRESH * HD>;            // (FRESH, HD): ATTN_ROPE's heads at the new position
var<workgroup> row_scale: array<f32, FRESH>;             // ATTN_ROPE: 1 / rms of each fresh head
var<workgroup> weights: array<array<f32, WG>, GROUP>;    // (group, block position)
var<workgroup> block_max: array<f32, GROUP>;
var<workgroup> block_sum: array<f32, GROUP>;

// Row-wise max (is_max) or sum of weights[0..group) over the block, into block_max / block_sum.
fn reduce_rows(lid: u32, is_max: bool) {
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            for (var g = 0u; g < GROUP; g++) {
                let a = weights[g][lid];
                let b = weights[g][lid + stride];
                weights[g][lid] = select(a + b, max(a, b), is_max);
            }
        }
        workgroupBarrier();
    }
    if (lid < GROUP) {
        if (is_max) {
            block_max[lid] = weights[lid][0];
        } else {
            block_sum[lid] = weights[lid][0];
        }
    }
    workgroupBarrier();
}

// ATTN_ROPE: the group's query heads and the K/V head's key at position pos, with bias, QK-norm
// and RoPE applied as rope.wgsl does, into `fresh`; the split holding pos writes K and V to the cache.
fn rope_fresh(lid: u32, token: u32, kv_head: u32, pos: u32, holds_pos: bool) {
    let n_q = R.n_head * HD;
    let q_src = token * R.qkv_stride + kv_head * GROUP * HD;
    let k_src = token * R.qkv_stride + n_q + kv_head * HD;
    for (var e = lid; e < FRESH * HD; e += WG) {
        let is_k = e >= GROUP * HD;
        let d = e % HD;
        var v = QKV[select(q_src + e, k_src + d, is_k)];
        if (R.qkv_bias == 1u) {
            v += bitcast<f32>(W[select(R.q_bias + kv_head * GROUP * HD + e, R.k_bias + kv_head * HD + d, is_k)]);
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
            row_scale[r] = 1.0 / sqrt(sum / f32(HD) + R.eps);
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
        let cache = (kv_head * R.n_ctx + pos) * HD / 4u;
        let v_cache = R.n_head_kv * R.n_ctx * HD / 4u + cache;
        let v_src = k_src + R.n_head_kv * HD;
        for (var i = lid; i < HD / 4u; i += WG) {
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
    storageBarrier();  // the cache rows written above are read below by other invocations
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let split = wid.x;
    let kv_head = wid.y;
    let token = wid.z;
    let hd = HD;
    let pos = S.n_past + token;
    var lo = 0u;
    if (P.window > 0u && pos + 1u > P.window) {
        lo = pos + 1u - P.window;
    }
    let begin = max(lo, split * S.split_len);
    let end = min(pos + 1u, (split + 1u) * S.split_len);
    let k_base = kv_head * P.n_ctx * hd;
    let v_base = P.n_head_kv * P.n_ctx * hd + k_base;

    if (ROPE == 1u) {
        rope_fresh(lid, token, kv_head, pos, begin <= pos && pos < end);
        for (var d = lid; d < GROUP * hd; d += WG) {
            q[d] = fresh[d] * P.scale;
        }
    } else {
        let q_src = token * P.qkv_stride + kv_head * GROUP * hd;
        for (var d = lid; d < GROUP * hd; d += WG) {
            q[d] = QKV[q_src + d] * P.scale;
        }
    }
    workgroupBarrier();

    var m: array<f32, GROUP>;
    var l: array<f32, GROUP>;
    var acc: array<f32, {ATTN_ACC}>;  // (GROUP, DIMS)
    for (var g = 0u; g < GROUP; g++) {
        m[g] = EMPTY;
    }
    for (var b = begin; b < end; b += WG) {
        let j = b + lid;
        let k_row = k_base + min(j, end - 1u) * hd;
        // each K value is loaded once and used for every query head of the group
        var scores: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            scores[g] = 0.0;  // explicitly: Naga zeroes a loop's `var` once, not on every iteration
        }
        for (var d = 0u; d < hd; d += 4u) {
            let k = KV[(k_row + d) / 4u];
            for (var g = 0u; g < GROUP; g++) {
                let qv = vec4<f32>(q[g * hd + d], q[g * hd + d + 1u], q[g * hd + d + 2u], q[g * hd + d + 3u]);
                scores[g] += dot(qv, k);
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            var score = scores[g];
            if (P.softcap > 0.0) {  // tanh saturates long before 20: clamping avoids inf / inf
                score = P.softcap * tanh(clamp(score / P.softcap, -20.0, 20.0));
            }
            scores[g] = score;
            weights[g][lid] = select(EMPTY, score, j < end);
        }
        workgroupBarrier();
        reduce_rows(lid, true);
        var correction: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            let new_m = max(m[g], block_max[g]);
            correction[g] = exp(m[g] - new_m);
            m[g] = new_m;
            weights[g][lid] = select(0.0, exp(scores[g] - new_m), j < end);
        }
        workgroupBarrier();
        // sum a copy: `weights` must survive for the V accumulation
        var p: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            p[g] = weights[g][lid];
        }
        workgroupBarrier();
        reduce_rows(lid, false);
        for (var g = 0u; g < GROUP; g++) {
            l[g] = l[g] * correction[g] + block_sum[g];
            weights[g][lid] = p[g];
        }
        workgroupBarrier();
        let n = min(WG, end - b);
        for (var k = 0u; k < DIMS; k++) {
            let d = lid + k * WG;
            if (d < hd) {
                var sums: array<f32, GROUP>;
                for (var g = 0u; g < GROUP; g++) {
                    sums[g] = acc[g * DIMS + k] * correction[g];
                }
                // V element d of position b + jj: vec4 number (v_base + (b + jj) hd + d) / 4, component d % 4
                let row4 = (v_base + b * hd + d - d % 4u) / 4u;
                for (var jj = 0u; jj < n; jj++) {
                    let v = KV[row4 + jj * (hd / 4u)][d % 4u];
                    for (var g = 0u; g < GROUP; g++) {
                        sums[g] += weights[g][jj] * v;
                    }
                }
                for (var g = 0u; g < GROUP; g++) {
                    acc[g * DIMS + k] = sums[g];
                }
            }
        }
        workgroupBarrier();
    }
    let n_splits = (S.n_past + S.n_tokens + S.split_len - 1u) / S.split_len;
    for (var g = 0u; g < GROUP; g++) {
        let h = kv_head * GROUP + g;
        let out = ((token * P.n_head + h) * n_splits + split) * (hd + 2u);
        for (var k = 0u; k < DIMS; k++) {
            let d = lid + k * WG;
            if (d < hd) {
                PART[out + d] = acc[g * DIMS + k];
                if (n_splits == 1u) {
                    OUT[(token * P.n_head + h) * hd + d] = acc[g * DIMS + k] / l[g];
                }
            }
        }
        if (lid == 0u) {
            PART[out + hd] = m[g];
            PART[out + hd + 1u] = l[g];
        }
    }
}
