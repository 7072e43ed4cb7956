// y = W x for batch-1 decode (also correct, if slow, for a few tokens: one token per workgroup row y).
// W stays quantized: rows of re-laid blocks decoded 4 values at a time by dq4 from quant/{QUANT}.wgsl.
// A workgroup makes ROWS output rows; its threads stride over the row in vec4 steps, keep ROWS partial
// sums in registers and reduce them (reduce_{REDUCE}.wgsl: subgroupAdd, else workgroup memory). Optional fusions (P.mode bits, activation.wgsl):
// RMSNorm of the input (every workgroup recomputes the RMS of x), the gated activation, residual add.
// Up to three weight segments (e.g. attn_q, attn_k, attn_v of one type) make one output vector.

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;     // invocations per workgroup (a power of two)
const ROWS: u32 = {GEMV_ROWS}u;  // output rows per workgroup, at most 4

#include "quant/{QUANT}.wgsl"
#include "activation.wgsl"
#include "reduce_{REDUCE}.wgsl"

// values 4i..4i+3 of the input row that starts at float `base` (a multiple of 4): one wide load
fn load_x(base: u32, i: u32) -> vec4<f32> {
    return X[base / 4u + i];
}

// 1 / sqrt(mean(x^2) + eps) of the token's input row, the same in every thread.
fn inverse_rms(base: u32, lid: u32) -> f32 {
    var sum = 0.0;
    for (var i = lid; i < P.cols / 4u; i += WG) {
        let v = load_x(base, i);
        sum += dot(v, v);
    }
    reduce_pair(vec4<f32>(sum, 0.0, 0.0, 0.0), vec4<f32>(0.0), lid);
    return 1.0 / sqrt(sum_a[0].x / f32(P.cols) + P.eps);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let token = wid.y;
    var x_token = token;
    if ((P.mode & MODE_X_STEP) != 0u) {
        x_token = S.lm_first + token;
    }
    let x_base = x_token * P.x_stride;
    let use_norm = (P.mode & MODE_NORM) != 0u;
    let is_gated = (P.mode & MODE_GATED) != 0u;
    var inv = 1.0;
    if (use_norm) {
        inv = inverse_rms(x_base, lid);
    }
    let row0 = wid.x * ROWS;
    var base_a: array<u32, ROWS>;
    var base_b: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let row = min(row0 + r, P.rows - 1u);
        base_a[r] = row_base(row);
        base_b[r] = P.w1 + row * P.row_words;
    }
    let per_block = QK / 4u;
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    for (var i = lid; i < P.cols / 4u; i += WG) {
        var xv = load_x(x_base, i);
        if (use_norm) {
            xv = xv * inv * norm_weight(i);
        }
        let blk = (i / per_block) * BLOCK_WORDS;
        let sub = i % per_block;
        for (var r = 0u; r < ROWS; r++) {
            acc_a[r] += dot(dq4(base_a[r] + blk, sub), xv);
            if (is_gated) {
                acc_b[r] += dot(dq4(base_b[r] + blk, sub), xv);
            }
        }
    }
    reduce_pair(acc_a, acc_b, lid);
    if (lid < ROWS && row0 + lid < P.rows) {
        var y = sum_a[0][lid];
        if (is_gated) {
            y = gated(P.mode, y, sum_b[0][lid]);
        }
        let at = token * P.y_stride + P.y_off + row0 + lid;
        if ((P.mode & MODE_ACCUMULATE) != 0u) {
            Y[at] = Y[at] + y;
        } else {
            Y[at] = y;
        }
    }
}
