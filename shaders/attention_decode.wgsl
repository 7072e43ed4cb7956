// Causal grouped-query attention of a chunk's queries over the K/V cache, split along the cache
// (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html): workgroup (split, head,
// token) covers positions [split * S.split_len, (split + 1) * S.split_len) that the query sees
// (j <= pos, and pos - j < window on sliding-window layers), runs an online softmax over blocks of 64
// positions and writes its unnormalized output with its running max and sum; attention_merge.wgsl
// combines the splits. Serves decode (one token) and prefill chunks alike.

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    n_ctx: u32,        // cache capacity in positions
    window: u32,       // 0: the whole context
    scale: f32,        // 1 / sqrt(head_dim)
    qkv_stride: u32,   // floats per token in QKV
}

struct Step {
    n_past: u32,
    n_tokens: u32,
    lm_first: u32,
    split_len: u32,
}

@group(0) @binding(0) var<storage, read> QKV: array<f32>;            // (tokens, n_q + 2 n_kv), Q rotated
@group(0) @binding(1) var<storage, read> KV: array<f32>;             // K then V: (n_head_kv, n_ctx, head_dim)
@group(0) @binding(2) var<storage, read_write> PART: array<f32>;     // (tokens, n_head, splits, head_dim + 2)
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = 64u;
const MAX_DIMS: u32 = 8u;    // head_dim <= WG * MAX_DIMS
const EMPTY: f32 = -1.0e30;  // finite "minus infinity": exp(EMPTY - m) is 0 without NaNs

var<workgroup> q: array<f32, 512>;
var<workgroup> weights: array<f32, WG>;
var<workgroup> scratch: array<f32, WG>;

fn workgroup_max(v: f32, lid: u32) -> f32 {
    scratch[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            scratch[lid] = max(scratch[lid], scratch[lid + stride]);
        }
        workgroupBarrier();
    }
    let result = scratch[0];
    workgroupBarrier();
    return result;
}

fn workgroup_sum(v: f32, lid: u32) -> f32 {
    scratch[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            scratch[lid] += scratch[lid + stride];
        }
        workgroupBarrier();
    }
    let result = scratch[0];
    workgroupBarrier();
    return result;
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let split = wid.x;
    let h = wid.y;
    let token = wid.z;
    let hd = P.head_dim;
    let pos = S.n_past + token;
    var lo = 0u;
    if (P.window > 0u && pos + 1u > P.window) {
        lo = pos + 1u - P.window;
    }
    let begin = max(lo, split * S.split_len);
    let end = min(pos + 1u, (split + 1u) * S.split_len);
    let kv_head = h / (P.n_head / P.n_head_kv);
    let k_base = kv_head * P.n_ctx * hd;
    let v_base = P.n_head_kv * P.n_ctx * hd + k_base;

    let q_src = token * P.qkv_stride + h * hd;
    for (var d = lid; d < hd; d += WG) {
        q[d] = QKV[q_src + d] * P.scale;
    }
    workgroupBarrier();

    var m = EMPTY;
    var l = 0.0;
    var acc: array<f32, MAX_DIMS>;
    for (var b = begin; b < end; b += WG) {
        let j = b + lid;
        var score = EMPTY;
        if (j < end) {
            score = 0.0;
            let k_row = k_base + j * hd;
            for (var d = 0u; d < hd; d += 4u) {
                let kv = vec4<f32>(KV[k_row + d], KV[k_row + d + 1u], KV[k_row + d + 2u], KV[k_row + d + 3u]);
                score += dot(vec4<f32>(q[d], q[d + 1u], q[d + 2u], q[d + 3u]), kv);
            }
        }
        let new_m = max(m, workgroup_max(score, lid));
        let correction = exp(m - new_m);
        var p = 0.0;
        if (j < end) {
            p = exp(score - new_m);
        }
        weights[lid] = p;
        l = l * correction + workgroup_sum(p, lid);
        m = new_m;
        let n = min(WG, end - b);
        for (var k = 0u; k < MAX_DIMS; k++) {
            let d = lid + k * WG;
            if (d < hd) {
                var sum = acc[k] * correction;
                for (var jj = 0u; jj < n; jj++) {
                    sum += weights[jj] * KV[v_base + (b + jj) * hd + d];
                }
                acc[k] = sum;
            }
        }
        workgroupBarrier();
    }
    let n_splits = (S.n_past + S.n_tokens + S.split_len - 1u) / S.split_len;
    let out = ((token * P.n_head + h) * n_splits + split) * (hd + 2u);
    for (var k = 0u; k < MAX_DIMS; k++) {
        let d = lid + k * WG;
        if (d < hd) {
            PART[out + d] = acc[k];
        }
    }
    if (lid == 0u) {
        PART[out + hd] = m;
        PART[out + hd + 1u] = l;
    }
}
