// Q6_K rows for gemv.wgsl's units (gemv/q6_k.wgsl, gemv/k_q6_k.wgsl): 32 weights a unit.
// quant/q6_k.wgsl's blocks of 53 words lie in groups of 4: the group's d as f32 first, then each
// block's 52 words, 16-byte aligned: vec4 [0..7] ql, [8..11] qh, [12] 16 int8 scales. Unit t = 4h + a
// of a block (t = u % 8) takes ql vec4 4h + a of half h, whose low nibbles are elements 16a..16a+15
// of the half and high nibbles elements 64 + 16a..; the 2 high bits of both come from qh vec4
// 2h + a % 2 (bits 2g, g = a / 2, and 2g + 4). The 6-bit quants (q + 32) are assembled in place as
// bytes and dotted four at a time with the unit's x rounded to 8 bits (gemv/x_int8.wgsl); the
// offset of 32 comes off the rounded x's sum. ql and qh are read as vec4 (the includer's quad_at),
// d and the two scale words as words (word_at): as vec4 with a select they cost more than the
// loads they save.

#include "quant/q6_k_words.wgsl"

const Q6K_BLOCK_WORDS: u32 = 53u;

// lo: the 16 x of the low nibbles' elements
fn q6k_x(x: u32, u: u32) -> X8x2 {
    let t = u & 7u;
    let at = 16u * (u >> 3u) + 8u * (t >> 2u) + (t & 3u);  // the unit's first block of 16 x
    return x8x2(x, at, at + 4u);
}

// signed byte `b` of word w as a float
fn q6k_int8_at(w: u32, b: u32) -> f32 {
    return f32(bitcast<i32>(w << (24u - 8u * b)) >> 24u);
}

// one unit of one row: its 4 ql and 4 qh words, d, and the words of its two scales
struct Q6kUnit {
    ql: vec4<u32>,
    qh: vec4<u32>,
    d: f32,
    sc_lo: u32,
    sc_hi: u32,
}

// blk: the block's address, its row's first word + 53 b (quant/q6_k_words.wgsl)
fn q6k_load(blk: u32, t: u32) -> Q6kUnit {
    let w = q6k_words(blk);
    let at = w.y / 4u;
    let h = t >> 2u;
    return Q6kUnit(quad_at(at + 4u * h + (t & 3u)), quad_at(at + 8u + 2u * h + (t & 1u)),
                   bitcast<f32>(word_at(w.x)), word_at(w.y + 48u + 2u * h), word_at(w.y + 49u + 2u * h));
}

// d sc ((q + 32) . x - 32 sum(x)) for both sub-blocks
fn q6k_dot(w: Q6kUnit, t: u32, x: X8x2) -> f32 {
    let a = t & 3u;
    let m = w.qh >> vec4<u32>(2u * (a >> 1u));
    let q_lo = low_nibbles(w.ql) | ((m & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let q_hi = high_nibbles(w.ql) | (((m >> vec4<u32>(4u)) & vec4<u32>(0x03030303u)) << vec4<u32>(4u));
    let lo = int_float(dot4(q_lo, x.lo.q) - 32 * x.lo.sum);
    let hi = int_float(dot4(q_hi, x.hi.q) - 32 * x.hi.sum);
    return w.d * (q6k_int8_at(w.sc_lo, a) * x.lo.step * lo + q6k_int8_at(w.sc_hi, a) * x.hi.step * hi);
}

// unit u of the 4 rows whose first words are `rows`
fn q6k_rows(rows: vec4<u32>, u: u32, x: X8x2) -> vec4<f32> {
    let t = u & 7u;
    let b = rows + vec4<u32>((u >> 3u) * Q6K_BLOCK_WORDS);
    // all loads first, so that they are in flight together
    let u0 = q6k_load(b.x, t);
    let u1 = q6k_load(b.y, t);
    let u2 = q6k_load(b.z, t);
    let u3 = q6k_load(b.w, t);
    return vec4<f32>(q6k_dot(u0, t, x), q6k_dot(u1, t, x), q6k_dot(u2, t, x), q6k_dot(u3, t, x));
}
