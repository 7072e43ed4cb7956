// y = W x for one token, W in Q4_K: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// quant/q4_k.wgsl's 144-byte block is 9 vec4: [0] d, dmin (f16) and the 12 bytes of 6-bit scales and
// mins, [1 + t] quant bytes 16t..16t+15. An invocation's unit of work is one quant vec4: 32 weights,
// 16 of sub-block 2c in its low nibbles and 16 of sub-block 2c + 1 in its high nibbles (c = t / 2), so
// 8 invocations share a super-block. Per unit, an invocation loads the 8 vec4 of x once for the
// workgroup's ROWS rows (and their up-projection partners when gated), decodes each row's two scales
// and mins once, and turns nibbles into floats with bit operations (as_floats). Wide loads: W is bound
// as vec4 (blocks and rows are 16-byte aligned). Fusions as gemv.wgsl (P.mode); the fused RMSNorm
// makes no extra pass over x (finish applies 1/rms after the reduction).

#include "matmul_structs.wgsl"

@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;      // invocations per workgroup (a power of two)
const ROWS: u32 = {GEMV_ROWS}u;  // output rows per workgroup
const BLOCK_VEC4: u32 = 9u;

#include "activation.wgsl"
#include "gemv_common.wgsl"

// The nibbles stay where they are in the word (bytes 2 and 3 shifted down by 16 to fit the 23-bit
// mantissa), so each float is the nibble times a power of two; x is pre-multiplied by the inverse.
const LOW_SCALE = vec4<f32>(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);
const HIGH_SCALE = vec4<f32>(1.0 / 16.0, 1.0 / 4096.0, 1.0 / 16.0, 1.0 / 4096.0);

fn low_nibbles(w: u32) -> vec4<f32> {
    return as_floats(vec4<u32>(w, w, w >> 16u, w >> 16u) & vec4<u32>(0xFu, 0xF00u, 0xFu, 0xF00u));
}

fn high_nibbles(w: u32) -> vec4<f32> {
    return as_floats(vec4<u32>(w, w, w >> 16u, w >> 16u) & vec4<u32>(0xF0u, 0xF000u, 0xF0u, 0xF000u));
}

// the unit's x (times the norm weight with MODE_NORM, times LOW_SCALE / HIGH_SCALE): 16 values under
// the low nibbles, 16 under the high ones
var<private> x_lo: array<vec4<f32>, 4>;
var<private> x_hi: array<vec4<f32>, 4>;

// Loads x_lo from vec4 at..at+3 of the row and x_hi from at+8..at+11; returns the plain sums of
// both halves (what the mins multiply) and adds x^2 to part[SQ].
fn load_x(row: u32, at: u32, use_norm: bool) -> vec2<f32> {
    var sums = vec2<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        var lo = X[row + at + k];
        var hi = X[row + at + 8u + k];
        if (use_norm) {
            part[SQ] += dot(lo, lo) + dot(hi, hi);
            lo *= bitcast<vec4<f32>>(W[P.norm_w / 4u + at + k]);
            hi *= bitcast<vec4<f32>>(W[P.norm_w / 4u + at + 8u + k]);
        }
        sums += vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0)));
        x_lo[k] = lo * LOW_SCALE;
        x_hi[k] = hi * HIGH_SCALE;
    }
    return sums;
}

// (scale of sub-block 2c, its min, scale of 2c + 1, its min) from the block's first vec4:
// quant/q4_k.wgsl's q4k_scale_min for two neighbouring sub-blocks at once, both bytes in one u32.
fn scales_mins(head: vec4<u32>, c: u32) -> vec4<f32> {
    let shift = 16u * (c & 1u);
    let a = head.y >> shift;
    let b = head.z >> shift;
    let e = head.w >> shift;
    let high = c >= 2u;
    let sc = select(a & 0x3F3Fu, (e & 0x0F0Fu) | ((a >> 2u) & 0x3030u), high);
    let mn = select(b & 0x3F3Fu, ((e >> 4u) & 0x0F0Fu) | ((b >> 2u) & 0x3030u), high);
    return as_floats(vec4<u32>(sc, mn, sc >> 8u, mn >> 8u) & vec4<u32>(0xFFu));
}

// one unit of one row: the block's first vec4 (scales) and the unit's quant vec4
struct Unit {
    head: vec4<u32>,
    q: vec4<u32>,
}

fn load_unit(blk: u32, t: u32) -> Unit {
    return Unit(W[blk], W[blk + 1u + t]);
}

// unit t dotted with x_lo / x_hi: d sc (q . x) - dmin m sum(x), for both sub-blocks
fn unit_dot(w: Unit, t: u32, sums: vec2<f32>) -> f32 {
    let d = unpack2x16float(w.head.x);
    let sm = scales_mins(w.head, t >> 1u);
    let lo = dot(low_nibbles(w.q.x), x_lo[0]) + dot(low_nibbles(w.q.y), x_lo[1])
           + dot(low_nibbles(w.q.z), x_lo[2]) + dot(low_nibbles(w.q.w), x_lo[3]);
    let hi = dot(high_nibbles(w.q.x), x_hi[0]) + dot(high_nibbles(w.q.y), x_hi[1])
           + dot(high_nibbles(w.q.z), x_hi[2]) + dot(high_nibbles(w.q.w), x_hi[3]);
    return d.x * (sm.x * lo + sm.z * hi) - d.y * (sm.y * sums.x + sm.w * sums.y);
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
    let n_units = P.cols / 32u;
    for (var u = lid; u < n_units; u += WG) {
        let t = u & 7u;
        let blk = (u >> 3u) * BLOCK_VEC4;
        // every row's weights first, so that all their loads are in flight together
        var w_a: array<Unit, ROWS>;
        var w_b: array<Unit, ROWS>;
        for (var r = 0u; r < ROWS; r++) {
            w_a[r] = load_unit(base_a[r] + blk, t);
        }
        if (is_gated) {
            for (var r = 0u; r < ROWS; r++) {
                w_b[r] = load_unit(base_b[r] + blk, t);
            }
        }
        let sums = load_x(row, 64u * (u >> 3u) + 16u * (t >> 1u) + 4u * (t & 1u), use_norm);
        for (var r = 0u; r < ROWS; r++) {
            part[r] += unit_dot(w_a[r], t, sums);
        }
        if (is_gated) {
            for (var r = 0u; r < ROWS; r++) {
                part[UP + r] += unit_dot(w_b[r], t, sums);
            }
        }
    }
    finish(lid, row0, token);
}
