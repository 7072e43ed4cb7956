// y = W x for one token, W in Q6_K: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// quant/q6_k.wgsl's block is 53 words (not 16-byte aligned, so W is read as words): [0] d as f32,
// [1..32] ql, [33..48] qh, [49..52] 16 int8 scales. An invocation's unit of work is 32 weights:
// unit t = 4h + a of a block takes ql words 16h + 4a .. +3 of half h, whose low nibbles are elements
// 16a..16a+15 of the half and high nibbles elements 64 + 16a..; the 2 high bits of both come from
// the same 4 qh words (bits 2g, g = a / 2, and 2g + 4). So 8 invocations share a super-block, each
// decoding the two scales of its two 16-weight sub-blocks once. Per unit, an invocation loads its
// 8 vec4 of x once for the workgroup's ROWS rows. Fusions as gemv.wgsl (P.mode).

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;      // invocations per workgroup (a power of two)
const ROWS: u32 = {GEMV_ROWS}u;  // output rows per workgroup
const BLOCK_WORDS: u32 = 53u;

#include "activation.wgsl"
#include "gemv_common.wgsl"

// the unit's x (times the norm weight with MODE_NORM, times BYTE_SCALE): 16 values of the low
// nibbles' sub-block, 16 of the high nibbles'
var<private> x_lo: array<vec4<f32>, 4>;
var<private> x_hi: array<vec4<f32>, 4>;

// Loads x_lo from vec4 at..at+3 of the row and x_hi from at+16..at+19; returns the plain sums of
// both halves (for the -32 offset of the quants) and adds x^2 to part[SQ].
fn load_x(row: u32, at: u32, use_norm: bool) -> vec2<f32> {
    var sums = vec2<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        var lo = X[row + at + k];
        var hi = X[row + at + 16u + k];
        if (use_norm) {
            part[SQ] += dot(lo, lo) + dot(hi, hi);
            lo *= norm_weight(at + k);
            hi *= norm_weight(at + 16u + k);
        }
        sums += vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0)));
        x_lo[k] = lo * BYTE_SCALE;
        x_hi[k] = hi * BYTE_SCALE;
    }
    return sums;
}

// signed byte `b` of word w as a float
fn int8_at(w: u32, b: u32) -> f32 {
    return f32(bitcast<i32>(w << (24u - 8u * b)) >> 24u);
}

// one unit of one row: its 4 ql and 4 qh words, d, and the words of its two scales
struct Unit {
    ql: vec4<u32>,
    qh: vec4<u32>,
    d: f32,
    sc_lo: u32,
    sc_hi: u32,
}

fn load_unit(blk: u32, t: u32) -> Unit {
    let h = t >> 2u;
    let ql = blk + 1u + 16u * h + 4u * (t & 3u);
    let qh = blk + 33u + 8u * h + 4u * (t & 1u);
    return Unit(vec4<u32>(W[ql], W[ql + 1u], W[ql + 2u], W[ql + 3u]),
                vec4<u32>(W[qh], W[qh + 1u], W[qh + 2u], W[qh + 3u]),
                bitcast<f32>(W[blk]), W[blk + 49u + 2u * h], W[blk + 50u + 2u * h]);
}

// unit t dotted with x_lo / x_hi: d sc ((q + 32) . x - 32 sum(x)) for both sub-blocks, the 6-bit
// q + 32 of each byte assembled in place (low nibble | 2 high bits << 4)
fn unit_dot(w: Unit, t: u32, sums: vec2<f32>) -> f32 {
    let a = t & 3u;
    let m = w.qh >> vec4<u32>(2u * (a >> 1u));
    let q_lo = (w.ql & vec4<u32>(0x0F0F0F0Fu)) | ((m & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let q_hi = ((w.ql >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu)) | (((m >> vec4<u32>(4u)) & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let lo = dot(bytes_scaled(q_lo.x), x_lo[0]) + dot(bytes_scaled(q_lo.y), x_lo[1])
           + dot(bytes_scaled(q_lo.z), x_lo[2]) + dot(bytes_scaled(q_lo.w), x_lo[3]);
    let hi = dot(bytes_scaled(q_hi.x), x_hi[0]) + dot(bytes_scaled(q_hi.y), x_hi[1])
           + dot(bytes_scaled(q_hi.z), x_hi[2]) + dot(bytes_scaled(q_hi.w), x_hi[3]);
    return w.d * (int8_at(w.sc_lo, a) * (lo - 32.0 * sums.x) + int8_at(w.sc_hi, a) * (hi - 32.0 * sums.y));
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
    let n_units = P.cols / 32u;
    for (var u = lid; u < n_units; u += WG) {
        let t = u & 7u;
        let blk = (u >> 3u) * BLOCK_WORDS;
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
        let sums = load_x(row, 64u * (u >> 3u) + 32u * (t >> 2u) + 4u * (t & 3u), use_norm);
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
