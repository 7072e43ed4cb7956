// y = W x for one token, W in BF16: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// Two bfloat16 per word (element 2k in the low half); a bfloat16 is the high half of an f32, so
// decoding only moves bits. An invocation's unit of work is UNIT weights (16 or 32): UNIT / 8 vec4
// loads of W (bound as vec4: rows of a multiple of 16 weights are 16-byte aligned) for every one of
// the workgroup's ROWS rows, then the unit's x once for all of them. Fusions as gemv.wgsl (P.mode).

#include "matmul_structs.wgsl"

@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;      // invocations per workgroup (a power of two)
const ROWS: u32 = {GEMV_ROWS}u;  // output rows per workgroup
const UNIT: u32 = {UNIT}u;       // weights per unit: 16 or 32
const UNIT_VEC4: u32 = UNIT / 8u;

#include "activation.wgsl"
#include "gemv_common.wgsl"

// the unit's x (times the norm weight with MODE_NORM)
var<private> xs: array<vec4<f32>, UNIT / 4u>;

// Loads xs from vec4 at.. of the row; adds x^2 to part[SQ].
fn load_x(row: u32, at: u32, use_norm: bool) {
    for (var k = 0u; k < UNIT / 4u; k++) {
        var v = X[row + at + k];
        if (use_norm) {
            part[SQ] += dot(v, v);
            v *= bitcast<vec4<f32>>(W[P.norm_w / 4u + at + k]);
        }
        xs[k] = v;
    }
}

// the 2 bfloat16 of each of two words as 4 floats
fn bf16x4(a: u32, b: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
}

struct Unit {
    w: array<vec4<u32>, UNIT_VEC4>,
}

fn load_unit(first: u32) -> Unit {
    var unit: Unit;
    for (var k = 0u; k < UNIT_VEC4; k++) {
        unit.w[k] = W[first + k];
    }
    return unit;
}

// the unit dotted with xs
fn unit_dot(unit: Unit) -> f32 {
    var acc = vec4<f32>(0.0);
    for (var k = 0u; k < UNIT_VEC4; k++) {
        let w = unit.w[k];
        acc += bf16x4(w.x, w.y) * xs[2u * k] + bf16x4(w.z, w.w) * xs[2u * k + 1u];
    }
    return dot(acc, vec4<f32>(1.0));
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let token = wid.y;
    let row = x_row(token);
    let use_norm = (P.mode & MODE_NORM) != 0u;
    let is_gated = (P.mode & MODE_GATED) != 0u;
    let row0 = wid.x * ROWS;
    var base_a: array<u32, ROWS>;  // first vec4 of each row (gate rows when gated)
    var base_b: array<u32, ROWS>;  // first vec4 of the up rows when gated
    for (var r = 0u; r < ROWS; r++) {
        let w_row = min(row0 + r, P.rows - 1u);
        base_a[r] = row_base(w_row) / 4u;
        base_b[r] = (P.w1 + w_row * P.row_words) / 4u;
    }
    let n_units = P.cols / UNIT;
    for (var u = lid; u < n_units; u += WG) {
        // every row's weights first, so that all their loads are in flight together
        var w_a: array<Unit, ROWS>;
        var w_b: array<Unit, ROWS>;
        for (var r = 0u; r < ROWS; r++) {
            w_a[r] = load_unit(base_a[r] + UNIT_VEC4 * u);
        }
        if (is_gated) {
            for (var r = 0u; r < ROWS; r++) {
                w_b[r] = load_unit(base_b[r] + UNIT_VEC4 * u);
            }
        }
        load_x(row, UNIT / 4u * u, use_norm);
        for (var r = 0u; r < ROWS; r++) {
            part[r] += unit_dot(w_a[r]);
        }
        if (is_gated) {
            for (var r = 0u; r < ROWS; r++) {
                part[UP + r] += unit_dot(w_b[r]);
            }
        }
    }
    finish(lid, row0, token);
}
