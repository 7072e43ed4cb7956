// y = W x for one token, W in Q8_0: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// quant/q8_0.wgsl's block is 9 words (d as f32, then 32 int8), not 16-byte aligned, so W is read as
// words. An invocation's unit of work is one block: it loads the block's 8 vec4 of x once for the
// workgroup's ROWS rows, and turns bytes into floats with bit operations (bytes_scaled of the bytes
// plus 128, then 128 sum(x) taken off). Fusions as gemv.wgsl (P.mode).

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;      // invocations per workgroup (a power of two)
const ROWS: u32 = {GEMV_ROWS}u;  // output rows per workgroup, at most 4
const BLOCK_WORDS: u32 = 9u;

#include "activation.wgsl"
#include "reduce_{REDUCE}.wgsl"
#include "gemv_common.wgsl"

// the block's x (times the norm weight with MODE_NORM, times BYTE_SCALE)
var<private> xs: array<vec4<f32>, 8>;

// Loads xs from vec4 at..at+7 of the row; returns their plain sum and adds x^2 to *sq.
fn load_x(row: u32, at: u32, use_norm: bool, sq: ptr<function, f32>) -> f32 {
    var sum = 0.0;
    for (var k = 0u; k < 8u; k++) {
        var v = X[row + at + k];
        if (use_norm) {
            *sq += dot(v, v);
            v *= norm_weight(at + k);
        }
        sum += dot(v, vec4<f32>(1.0));
        xs[k] = v * BYTE_SCALE;
    }
    return sum;
}

// the block at word `blk` dotted with xs: d ((q + 128) . x - 128 sum(x))
fn unit_dot(blk: u32, sum: f32) -> f32 {
    var acc = 0.0;
    for (var k = 0u; k < 8u; k++) {
        acc += dot(bytes_scaled(W[blk + 1u + k] ^ 0x80808080u), xs[k]);
    }
    return bitcast<f32>(W[blk]) * (acc - 128.0 * sum);
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let token = wid.y;
    let row = x_row(token);
    let use_norm = (P.mode & MODE_NORM) != 0u;
    let is_gated = (P.mode & MODE_GATED) != 0u;
    let row0 = wid.x * ROWS;
    var base_a: array<u32, ROWS>;  // first word of each row (gate rows when gated)
    var base_b: array<u32, ROWS>;  // first word of the up rows when gated
    for (var r = 0u; r < ROWS; r++) {
        let w_row = min(row0 + r, P.rows - 1u);
        base_a[r] = row_base(w_row);
        base_b[r] = P.w1 + w_row * P.row_words;
    }
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    var sq = 0.0;
    let n_units = P.cols / 32u;
    for (var u = lid; u < n_units; u += WG) {
        let sum = load_x(row, 8u * u, use_norm, &sq);
        let blk = u * BLOCK_WORDS;
        for (var r = 0u; r < ROWS; r++) {
            acc_a[r] += unit_dot(base_a[r] + blk, sum);
            if (is_gated) {
                acc_b[r] += unit_dot(base_b[r] + blk, sum);
            }
        }
    }
    finish(acc_a, acc_b, sq, lid, row0, token);
}
