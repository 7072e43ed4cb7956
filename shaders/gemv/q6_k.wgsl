// gemv.wgsl's unit for Q6_K: 32 weights. quant/q6_k.wgsl's block is 53 words (not 16-byte aligned,
// so W is read as words): [0] d as f32, [1..32] ql, [33..48] qh, [49..52] 16 int8 scales. Unit
// t = 4h + a of a block (t = u % 8) takes ql words 16h + 4a .. +3 of half h, whose low nibbles are
// elements 16a..16a+15 of the half and high nibbles elements 64 + 16a..; the 2 high bits of both
// come from the same 4 qh words (bits 2g, g = a / 2, and 2g + 4). The 6-bit quants (q + 32) are
// assembled in place as bytes and dotted four at a time with the unit's x rounded to 8 bits
// (gemv/x_int8.wgsl); the offset of 32 comes off the rounded x's sum.

#include "gemv/words.wgsl"
#include "gemv/x_int8.wgsl"

const UNIT: u32 = 32u;
const BLOCK_WORDS: u32 = 53u;

struct XU {
    lo: X8,  // the 16 x of the low nibbles' elements
    hi: X8,
    sq: f32,
}

fn unit_x(x: u32, u: u32) -> XU {
    let t = u & 7u;
    let at = 16u * (u >> 3u) + 8u * (t >> 2u) + (t & 3u);  // the unit's first block of 16 x
    let lo = x8(x, at);
    let hi = x8(x, at + 4u);
    return XU(lo, hi, lo.sq + hi.sq);
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

// d sc ((q + 32) . x - 32 sum(x)) for both sub-blocks
fn unit_dot(w: Unit, t: u32, x: XU) -> f32 {
    let a = t & 3u;
    let m = w.qh >> vec4<u32>(2u * (a >> 1u));
    let q_lo = (w.ql & vec4<u32>(0x0F0F0F0Fu)) | ((m & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let q_hi = ((w.ql >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu))
             | (((m >> vec4<u32>(4u)) & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let lo = int_float(dot4(q_lo, x.lo.q) - 32 * x.lo.sum);
    let hi = int_float(dot4(q_hi, x.hi.q) - 32 * x.hi.sum);
    return w.d * (int8_at(w.sc_lo, a) * x.lo.step * lo + int8_at(w.sc_hi, a) * x.hi.step * hi);
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    let t = u & 7u;
    let b = rows + vec4<u32>((u >> 3u) * BLOCK_WORDS);
    // all loads first, so that they are in flight together
    let u0 = load_unit(b.x, t);
    let u1 = load_unit(b.y, t);
    let u2 = load_unit(b.z, t);
    let u3 = load_unit(b.w, t);
    return vec4<f32>(unit_dot(u0, t, x), unit_dot(u1, t, x), unit_dot(u2, t, x), unit_dot(u3, t, x));
}
