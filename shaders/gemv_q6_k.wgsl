// y = W x for one token, W in Q6_K: the decode matmul of AIRFRAME_GEMV_KIND=typed for this type.
// quant/q6_k.wgsl's block is 53 words (not 16-byte aligned, so W is read as words): [0] d as f32,
// [1..32] ql, [33..48] qh, [49..52] 16 int8 scales. An invocation's unit of work is 32 weights:
// unit t = 4h + a of a block takes ql words 16h + 4a .. +3 of half h, whose low nibbles are elements
// 16a..16a+15 of the half and high nibbles elements 64 + 16a..; the 2 high bits of both come from
// the same 4 qh words (bits 2g, g = a / 2, and 2g + 4). So 8 invocations share a super-block, each
// decoding the two scales of its two 16-weight sub-blocks once. Per unit, an invocation loads the
// unit of each of the workgroup's 4 rows, then its 8 vec4 of x once for all of them. Fusions as
// gemv.wgsl (P.mode).

#include "matmul_params.wgsl"

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;  // rows of x_stride / 4 vec4
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<uniform> S: Step;

const WG: u32 = {GEMV_WG}u;  // invocations per workgroup (a power of two)
const BLOCK_WORDS: u32 = 53u;

#include "activation.wgsl"
#include "reduce_{REDUCE}.wgsl"
#include "gemv_common.wgsl"

// 4 vec4 of the f32 norm weight from vec4 i on
fn norm16(i: u32) -> mat4x4<f32> {
    return mat4x4<f32>(norm_weight(i), norm_weight(i + 1u), norm_weight(i + 2u), norm_weight(i + 3u));
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

// unit t dotted with its x: d sc ((q + 32) . x - 32 sum(x)) for both sub-blocks, the 6-bit q + 32
// of each byte assembled in place (low nibble | 2 high bits << 4)
fn unit_dot(w: Unit, t: u32, lo: X16, hi: X16) -> f32 {
    let a = t & 3u;
    let m = w.qh >> vec4<u32>(2u * (a >> 1u));
    let q_lo = (w.ql & vec4<u32>(0x0F0F0F0Fu)) | ((m & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let q_hi = ((w.ql >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu)) | (((m >> vec4<u32>(4u)) & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let dot_lo = dot(bytes_scaled(q_lo.x), lo.v[0]) + dot(bytes_scaled(q_lo.y), lo.v[1])
               + dot(bytes_scaled(q_lo.z), lo.v[2]) + dot(bytes_scaled(q_lo.w), lo.v[3]);
    let dot_hi = dot(bytes_scaled(q_hi.x), hi.v[0]) + dot(bytes_scaled(q_hi.y), hi.v[1])
               + dot(bytes_scaled(q_hi.z), hi.v[2]) + dot(bytes_scaled(q_hi.w), hi.v[3]);
    return w.d * (int8_at(w.sc_lo, a) * (dot_lo - 32.0 * lo.sum) + int8_at(w.sc_hi, a) * (dot_hi - 32.0 * hi.sum));
}

// unit t of the 4 rows whose blocks start at word b, dotted with its x
fn rows_dot(b: vec4<u32>, t: u32, lo: X16, hi: X16) -> vec4<f32> {
    // all loads first, so that they are in flight together
    let u0 = load_unit(b.x, t);
    let u1 = load_unit(b.y, t);
    let u2 = load_unit(b.z, t);
    let u3 = load_unit(b.w, t);
    return vec4<f32>(unit_dot(u0, t, lo, hi), unit_dot(u1, t, lo, hi), unit_dot(u2, t, lo, hi), unit_dot(u3, t, lo, hi));
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lid3.x;
    let g = group_of(wid);
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    var sq = 0.0;
    let n_units = P.cols / 32u;
    var norm_lo = mat4x4<f32>();
    var norm_hi = mat4x4<f32>();
    for (var u = lid; u < n_units; u += WG) {
        let t = u & 7u;
        let blk = vec4<u32>((u >> 3u) * BLOCK_WORDS);
        let at = 64u * (u >> 3u) + 32u * (t >> 2u) + 4u * (t & 3u);  // the unit's first x vec4
        if (g.use_norm) {
            norm_lo = norm16(at);
            norm_hi = norm16(at + 16u);
        }
        let lo = x16(g.x, at, g.use_norm, norm_lo, BYTE_SCALE);
        let hi = x16(g.x, at + 16u, g.use_norm, norm_hi, BYTE_SCALE);
        sq += lo.sq + hi.sq;
        acc_a += rows_dot(g.a + blk, t, lo, hi);
        if (g.is_gated) {
            acc_b += rows_dot(g.b + blk, t, lo, hi);
        }
    }
    finish(acc_a, acc_b, sq, lid, g);
}
