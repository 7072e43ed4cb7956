// Y = X W^T with ROWS weight rows x TOKENS tokens per invocation and no workgroup memory in the inner
// loop: the variant for CPU adapters (lavapipe), which run invocations as SIMD lanes, so every load
// is a gather; decoded weights and loaded inputs are each reused ROWS x TOKENS / (ROWS + TOKENS) times. Params and Step from matmul_params.wgsl; the same bindings and P.mode fusions as gemv.wgsl.
// With MODE_NORM the norm weight is folded into the weights and 1/rms applied to the sums.

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

#include "quant/{QUANT}.wgsl"
#include "activation.wgsl"

const WG: u32 = 64u;
const TOKENS: u32 = {ROWS_TOKENS}u;  // 1 to 8: a decode batch of 3 costs 3 tokens, a chunk tiles of 8
const ROWS: u32 = 4u;

var<workgroup> inv_rms: array<f32, TOKENS>;

// values 4i..4i+3 of the input row that starts at float `base` (a multiple of 4)
fn load_x(base: u32, i: u32) -> vec4<f32> {
    return X[base / 4u + i];
}

// Values 4i..4i+3 of the ROWS rows at base_a (then of the gate's partner rows at base_b, or zeros),
// times the norm weight when the input is normalized.
fn weights(base_a: array<u32, ROWS>, base_b: array<u32, ROWS>, i: u32, use_norm: bool,
           is_gated: bool) -> array<vec4<f32>, 8> {
    let per_block = QK / 4u;
    let blk = (i / per_block) * BLOCK_WORDS;
    let sub = i % per_block;
    var nw = vec4<f32>(1.0);
    if (use_norm) {
        nw = norm_weight(i);
    }
    var w: array<vec4<f32>, 8>;
    for (var r = 0u; r < ROWS; r++) {
        w[r] = dq4(base_a[r] + blk, sub) * nw;
        if (is_gated) {
            w[ROWS + r] = dq4(base_b[r] + blk, sub) * nw;
        }
    }
    return w;
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let tok0 = wid.y * TOKENS;
    var x_first = 0u;
    if ((P.mode & MODE_X_STEP) != 0u) {
        x_first = S.lm_first;
    }
    let n_tokens = min(TOKENS, S.n_tokens - tok0);
    let use_norm = (P.mode & MODE_NORM) != 0u;
    let is_gated = (P.mode & MODE_GATED) != 0u;
    if (lid < TOKENS) {
        var inv = 1.0;
        if (use_norm) {
            let base = (x_first + tok0 + min(lid, n_tokens - 1u)) * P.x_stride;
            var sum = 0.0;
            for (var i = 0u; i < P.cols / 4u; i++) {
                let v = load_x(base, i);
                sum += dot(v, v);
            }
            inv = 1.0 / sqrt(sum / f32(P.cols) + P.eps);
        }
        inv_rms[lid] = inv;
    }
    workgroupBarrier();
    let row0 = (wid.x * WG + lid) * ROWS;
    if (row0 >= P.rows) {
        return;
    }
    var base_a: array<u32, ROWS>;
    var base_b: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let row = min(row0 + r, P.rows - 1u);
        base_a[r] = row_base(row);
        base_b[r] = P.w1 + row * P.row_words;
    }
    var x_rows: array<u32, TOKENS>;
    for (var t = 0u; t < TOKENS; t++) {
        x_rows[t] = (x_first + tok0 + min(t, n_tokens - 1u)) * P.x_stride;
    }
    var acc_a: array<vec4<f32>, TOKENS>;  // (token) x 4 rows
    var acc_b: array<vec4<f32>, TOKENS>;
    for (var i = 0u; i < P.cols / 4u; i++) {
        let w = weights(base_a, base_b, i, use_norm, is_gated);
        for (var t = 0u; t < TOKENS; t++) {  // a constant trip count keeps the sums in registers
            let xv = load_x(x_rows[t], i);
            acc_a[t] += vec4<f32>(dot(w[0], xv), dot(w[1], xv), dot(w[2], xv), dot(w[3], xv));
            if (is_gated) {
                acc_b[t] += vec4<f32>(dot(w[4], xv), dot(w[5], xv), dot(w[6], xv), dot(w[7], xv));
            }
        }
    }
    for (var t = 0u; t < n_tokens; t++) {
        for (var r = 0u; r < ROWS; r++) {
            let row = row0 + r;
            if (row < P.rows) {
                write_y(P.mode, (tok0 + t) * P.y_stride + P.y_off + row, acc_a[t][r], acc_b[t][r], inv_rms[t]);
            }
        }
    }
}
