// Q6_K rows for gemv.wgsl's units (gemv/q6_k.wgsl, gemv/k_q6_k.wgsl): 32 weights a unit.
// quant/q6_k.wgsl's block is 53 words (not 16-byte aligned, so W is read as words): [0] d as f32,
// [1..32] ql, [33..48] qh, [49..52] 16 int8 scales. Unit t = 4h + a of a block (t = u % 8) takes
// ql words 16h + 4a .. +3 of half h, whose low nibbles are elements 16a..16a+15 of the half and high
// nibbles elements 64 + 16a..; the 2 high bits of both come from the same 4 qh words (bits 2g,
// g = a / 2, and 2g + 4). The 6-bit quants (q + 32) are assembled in place as bytes and dotted four
// at a time with the unit's x rounded to 8 bits (gemv/x_int8.wgsl); the offset of 32 comes off the
// rounded x's sum.

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

fn q6k_load(blk: u32, t: u32) -> Q6kUnit {
    let h = t >> 2u;
    let ql = blk + 1u + 16u * h + 4u * (t & 3u);
    let qh = blk + 33u + 8u * h + 4u * (t & 1u);
    return Q6kUnit(vec4<u32>(W[ql], W[ql + 1u], W[ql + 2u], W[ql + 3u]),
                   vec4<u32>(W[qh], W[qh + 1u], W[qh + 2u], W[qh + 3u]),
                   bitcast<f32>(W[blk]), W[blk + 49u + 2u * h], W[blk + 50u + 2u * h]);
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
