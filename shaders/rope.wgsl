// RoPE on the fresh Q and K heads of a chunk, the optional per-head RMSNorm before it (qk_norm),
// and the K/V cache write, in one dispatch: workgroup (head, token) for head < n_head rotates Q in
// place; the next n_head_kv workgroups rotate K and store K and V at the token's position.
// Angles come from a table made on the CPU in float64: cos/sin of p * base^(-2i/rope_dim) (/ freq factor).
// Decode tokens skip this dispatch: attention_decode.wgsl does the same work for its one position.
// With qkv_bias, the f32 biases in W are added to Q, K and V first (Qwen 2).
// After K-split QKV matmuls (gemm.wgsl) it reads Q, K and V as the sums of their partials (P.splits0 ..):
// the work of split_sum.wgsl, without its dispatch and its pass over QKV; the rotated Q still goes
// to QKV, where attention reads it.

#include "rope_params.wgsl"

#include "step.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> T: array<f32>;           // (bases, n_ctx, rope_dim / 2, 2)
@group(0) @binding(2) var<storage, read_write> QKV: array<f32>;    // (tokens, n_q + 2 n_kv)
@group(0) @binding(3) var<storage, read_write> KV: array<f32>;     // K then V: (n_head_kv, n_ctx, head_dim) each
@group(0) @binding(4) var<uniform> P: RopeParams;
@group(0) @binding(5) var<uniform> S: Step;
@group(0) @binding(6) var<storage, read> PART0: array<f32>;  // the QKV groups' partials (P.splits0 ..)
@group(0) @binding(7) var<storage, read> PART1: array<f32>;
@group(0) @binding(8) var<storage, read> PART2: array<f32>;

const WG: u32 = 64u;
var<workgroup> head: array<f32, 512>;

#include "workgroup_reduce.wgsl"

fn inverse_rms(lid: u32) -> f32 {
    var sum = 0.0;
    for (var d = lid; d < P.head_dim; d += WG) {
        sum += head[d] * head[d];
    }
    return inverseSqrt(workgroup_sum(sum, lid) / f32(P.head_dim) + P.eps);
}

// column c of the token's QKV row
fn qkv_at(token: u32, c: u32) -> f32 {
    var g = 0u;  // the column's group: its splits and columns start .. end
    var splits = P.splits0;
    var start = 0u;
    var end = P.start1;
    if (c >= P.start2) {
        g = 2u;
        splits = P.splits2;
        start = P.start2;
        end = P.qkv_stride;
    } else if (c >= P.start1) {
        g = 1u;
        splits = P.splits1;
        start = P.start1;
        end = P.start2;
    }
    if (splits == 0u) {
        return QKV[token * P.qkv_stride + c];
    }
    var sum = 0.0;
    for (var s = 0u; s < splits; s++) {
        let at = (s * S.n_tokens + token) * (end - start) + c - start;
        if (g == 2u) {
            sum += PART2[at];
        } else if (g == 1u) {
            sum += PART1[at];
        } else {
            sum += PART0[at];
        }
    }
    return sum;
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let h = wid.x;
    let token = wid.y;
    let pos = S.n_past + token;
    let is_q = h < P.n_head;
    let n_q = P.n_head * P.head_dim;
    let n_kv = P.n_head_kv * P.head_dim;
    let kv_head = h - select(P.n_head, 0u, is_q);
    let col = select(n_q + kv_head * P.head_dim, h * P.head_dim, is_q);
    let src = token * P.qkv_stride + col;
    let bias = select(P.k_bias + kv_head * P.head_dim, P.q_bias + h * P.head_dim, is_q);
    for (var d = lid; d < P.head_dim; d += WG) {
        head[d] = qkv_at(token, col + d);
        if (P.qkv_bias == 1u) {
            head[d] += bitcast<f32>(W[bias + d]);
        }
    }
    workgroupBarrier();
    if (P.qk_norm == 1u) {
        let inv = inverse_rms(lid);
        let w = select(P.k_norm_w, P.q_norm_w, is_q);
        for (var d = lid; d < P.head_dim; d += WG) {
            head[d] = head[d] * inv * bitcast<f32>(W[w + d]);
        }
        workgroupBarrier();
    }
    for (var i = lid; i < P.rope_dim / 2u; i += WG) {
        let at = P.table + (pos * (P.rope_dim / 2u) + i) * 2u;
        let c = T[at];
        let s = T[at + 1u];
        let p = rope_pair(i, P.neox, P.rope_dim);
        let a = head[p.x];
        let b = head[p.y];
        head[p.x] = a * c - b * s;  // every thread writes only its own pairs
        head[p.y] = a * s + b * c;
    }
    workgroupBarrier();
    if (is_q) {
        for (var d = lid; d < P.head_dim; d += WG) {
            QKV[src + d] = head[d];
        }
        return;
    }
    let cache = (kv_head * P.n_ctx + pos) * P.head_dim;
    let v_col = n_q + n_kv + kv_head * P.head_dim;
    let v_cache = P.n_head_kv * P.n_ctx * P.head_dim + cache;
    for (var d = lid; d < P.head_dim; d += WG) {
        KV[cache + d] = head[d];
        var v = qkv_at(token, v_col + d);
        if (P.qkv_bias == 1u) {
            v += bitcast<f32>(W[P.v_bias + kv_head * P.head_dim + d]);
        }
        KV[v_cache + d] = v;
    }
}
