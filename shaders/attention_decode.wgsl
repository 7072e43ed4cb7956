// Causal grouped-query attention of a chunk's queries over the K/V cache, split along the cache
// (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html). Workgroup (split,
// kv head, token) serves every query head of its K/V group, so each K and V row is read once for
// the group: it covers positions [split * S.split_len, (split + 1) * S.split_len) that the query
// sees (j <= pos, and pos - j < window on sliding-window layers), runs an online softmax over blocks
// of 64 positions and writes, per query head, its unnormalized output with its running max and sum;
// attention_merge.wgsl combines the splits. When there is a single split (short contexts) the
// workgroup also writes the normalized output to OUT itself, exactly what the merge would write
// (acc / l), and the runtime skips the merge dispatch. Serves decode and prefill chunks alike.

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

@group(0) @binding(0) var<storage, read> QKV: array<f32>;            // (tokens, n_q + 2 n_kv), Q rotated
@group(0) @binding(1) var<storage, read> KV: array<vec4<f32>>;       // K then V: (n_head_kv, n_ctx, head_dim / 4)
@group(0) @binding(2) var<storage, read_write> PART: array<f32>;     // (tokens, n_head, splits, head_dim + 2)
@group(0) @binding(3) var<storage, read_write> OUT: array<f32>;      // (tokens, n_head * head_dim), one split only
@group(0) @binding(4) var<uniform> P: Params;
@group(0) @binding(5) var<uniform> S: Step;

const WG: u32 = 64u;
// The model's shape is fixed per pipeline (kernels.attention_defines), so every per-head loop has a
// constant trip count and the per-head arrays below can live in registers.
const GROUP: u32 = {ATTN_GROUP}u;     // query heads per K/V head (P.n_head / P.n_head_kv)
const HD: u32 = {ATTN_HEAD_DIM}u;     // head_dim (P.head_dim), a multiple of 4
const DIMS: u32 = {ATTN_DIMS}u;       // head dims per invocation and query head: ceil(HD / WG)
const EMPTY: f32 = -1.0e30;   // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs

var<workgroup> q: array<f32, {ATTN_Q}>;                  // (GROUP, HD), pre-scaled
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

    let q_src = token * P.qkv_stride + kv_head * GROUP * hd;
    for (var d = lid; d < GROUP * hd; d += WG) {
        q[d] = QKV[q_src + d] * P.scale;
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
