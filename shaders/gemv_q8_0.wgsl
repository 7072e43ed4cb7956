// y = W x for one token, W in Q8_0: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// quant/q8_0.wgsl's block is 9 words (d as f32, then 32 int8), not 16-byte aligned, so W is read as
// words. An invocation's unit of work is UNIT weights (a whole block, or half of one): it loads the
// unit of every one of the workgroup's ROWS rows, then the unit's x once for all of them, and turns
// bytes into floats with bit operations (bytes_scaled of the bytes plus 128, then 128 sum(x) taken
// off). Fusions as gemv.wgsl (P.mode).

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;      // invocations per workgroup (a power of two)
const ROWS: u32 = {GEMV_ROWS}u;  // output rows per workgroup
const UNIT: u32 = {UNIT}u;       // weights per unit: 16 or 32
const UNIT_WORDS: u32 = UNIT / 4u;
const UNITS_PER_BLOCK: u32 = 32u / UNIT;
const BLOCK_WORDS: u32 = 9u;

#include "activation.wgsl"
#include "gemv_common.wgsl"

// the unit's x (times the norm weight with MODE_NORM, times BYTE_SCALE)
var<private> xs: array<vec4<f32>, UNIT_WORDS>;

// Loads xs from vec4 at..at+UNIT_WORDS-1 of the row; returns their plain sum and adds x^2 to part[SQ].
fn load_x(row: u32, at: u32, use_norm: bool) -> f32 {
    var sum = 0.0;
    for (var k = 0u; k < UNIT_WORDS; k++) {
        var v = X[row + at + k];
        if (use_norm) {
            part[SQ] += dot(v, v);
            v *= norm_weight(at + k);
        }
        sum += dot(v, vec4<f32>(1.0));
        xs[k] = v * BYTE_SCALE;
    }
    return sum;
}

// one unit of one row: its block's d and its quant words
struct Unit {
    d: f32,
    q: array<u32, UNIT_WORDS>,
}

// unit u of the row at word `base`
fn load_unit(base: u32, u: u32) -> Unit {
    let blk = base + (u / UNITS_PER_BLOCK) * BLOCK_WORDS;
    let first = blk + 1u + (u % UNITS_PER_BLOCK) * UNIT_WORDS;
    var w: Unit;
    w.d = bitcast<f32>(W[blk]);
    for (var k = 0u; k < UNIT_WORDS; k++) {
        w.q[k] = W[first + k];
    }
    return w;
}

// the unit dotted with xs: d ((q + 128) . x - 128 sum(x))
fn unit_dot(w: Unit, sum: f32) -> f32 {
    var acc = 0.0;
    for (var k = 0u; k < UNIT_WORDS; k++) {
        acc += dot(bytes_scaled(w.q[k] ^ 0x80808080u), xs[k]);
    }
    return w.d * (acc - 128.0 * sum);
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
    let n_units = P.cols / UNIT;
    for (var u = lid; u < n_units; u += WG) {
        // every row's weights first, so that all their loads are in flight together
        var w_a: array<Unit, ROWS>;
        var w_b: array<Unit, ROWS>;
        for (var r = 0u; r < ROWS; r++) {
            w_a[r] = load_unit(base_a[r], u);
        }
        if (is_gated) {
            for (var r = 0u; r < ROWS; r++) {
                w_b[r] = load_unit(base_b[r], u);
            }
        }
        let sum = load_x(row, UNIT_WORDS * u, use_norm);
        for (var r = 0u; r < ROWS; r++) {
            part[r] += unit_dot(w_a[r], sum);
        }
        if (is_gated) {
            for (var r = 0u; r < ROWS; r++) {
                part[UP + r] += unit_dot(w_b[r], sum);
            }
        }
    }
    finish(lid, row0, token);
}
