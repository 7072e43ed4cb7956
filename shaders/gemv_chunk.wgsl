// y = W x for batch-1 decode, in chunks: each invocation takes CHUNK consecutive vec4 of the row
// (64 weights for Q4_K, 32 for the others), loads that piece of x into registers once for all ROWS
// rows of the workgroup, and dots it with each row through chunk_dot (chunk_{QUANT}.wgsl where one
// exists: block scales decoded once per chunk instead of once per 4 weights; else chunk_generic.wgsl,
// dq4 four weights at a time). Same parameters, bindings and fusions as gemv.wgsl, which stays the
// one-vec4-per-step variant (AIRFRAME_GEMV_KIND picks). The fused RMSNorm costs no extra pass over
// x: rmsnorm(x) . w = inv_rms * ((x * norm) . w), so each invocation adds up x^2 of the chunks it
// already loaded and the scale is applied once, after the reduction.

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;      // invocations per workgroup (a power of two)
const ROWS: u32 = {GEMV_ROWS}u;  // output rows per workgroup, at most 4
const CHUNK: u32 = {CHUNK}u;     // vec4 of the row per chunk (a divisor of the quant's block, or a multiple)

// this invocation's piece of x (times the norm weight with MODE_NORM), read by chunk_dot
var<private> xs: array<vec4<f32>, CHUNK>;

#include "quant/{QUANT}.wgsl"
#include "{CHUNK_DOT}.wgsl"
#include "activation.wgsl"
#include "reduce_{REDUCE}.wgsl"

// x vec4 number i of the token (times the norm weight with MODE_NORM); adds its squares to *sq
fn load_x(x_base: u32, i: u32, use_norm: bool, sq: ptr<function, f32>) -> vec4<f32> {
    let v = X[x_base / 4u + i];
    if (use_norm) {
        *sq += dot(v, v);
        return v * norm_weight(i);
    }
    return v;
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
    let row0 = wid.x * ROWS;
    var base_a: array<u32, ROWS>;
    var base_b: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let row = min(row0 + r, P.rows - 1u);
        base_a[r] = row_base(row);
        base_b[r] = P.w1 + row * P.row_words;
    }
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    var sq = 0.0;
    let n_vec4 = P.cols / 4u;
    let n_chunks = n_vec4 / CHUNK;
    for (var j = lid; j < n_chunks; j += WG) {
        for (var u = 0u; u < CHUNK; u++) {
            xs[u] = load_x(x_base, j * CHUNK + u, use_norm, &sq);
        }
        for (var r = 0u; r < ROWS; r++) {
            acc_a[r] += chunk_dot(base_a[r], j);
            if (is_gated) {
                acc_b[r] += chunk_dot(base_b[r], j);
            }
        }
    }
    // a row whose length is not a whole number of chunks (only float types allow that): the rest 4 at a time
    let per_block = QK / 4u;
    for (var i = n_chunks * CHUNK + lid; i < n_vec4; i += WG) {
        let xv = load_x(x_base, i, use_norm, &sq);
        let blk = (i / per_block) * BLOCK_WORDS;
        for (var r = 0u; r < ROWS; r++) {
            acc_a[r] += dot(dq4(base_a[r] + blk, i % per_block), xv);
            if (is_gated) {
                acc_b[r] += dot(dq4(base_b[r] + blk, i % per_block), xv);
            }
        }
    }
    reduce_three(acc_a, acc_b, sq, lid);
    if (lid < ROWS && row0 + lid < P.rows) {
        var inv = 1.0;
        if (use_norm) {
            inv = 1.0 / sqrt(sum_c[0] / f32(P.cols) + P.eps);
        }
        var y = inv * sum_a[0][lid];
        if (is_gated) {
            y = gated(P.mode, y, inv * sum_b[0][lid]);
        }
        let at = token * P.y_stride + P.y_off + row0 + lid;
        if ((P.mode & MODE_ACCUMULATE) != 0u) {
            Y[at] = Y[at] + y;
        } else {
            Y[at] = y;
        }
    }
}
