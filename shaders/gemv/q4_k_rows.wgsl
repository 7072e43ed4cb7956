// Q4_K rows for gemv.wgsl's units (gemv/q4_k.wgsl, gemv/q4_k_q6_k.wgsl; gemv/q5_k_rows.wgsl reads
// its scales and x the same way). A unit is one quant vec4 of a block, 32 weights: 16 of sub-block
// 2c in its low nibbles and 16 of sub-block 2c + 1 in its high nibbles (c = t / 2, t = u % 8), so
// 8 units share a super-block. quant/q4_k.wgsl's 144-byte block is 9 vec4: [0] d, dmin (f16) and
// the 12 bytes of 6-bit scales and mins, [1 + t] quant bytes 16t..16t+15. The unit's x is rounded
// to 8 bits (gemv/x_int8.wgsl) and each quant word's nibbles, masked into bytes, are dotted with it
// four at a time; the minimums come off the rounded x's sum, so a row's sum is the exact product of
// its weights with the rounded x. The weights are read as vec4 (blocks and rows are 16-byte
// aligned) through the includer's quad_at.

const Q4K_BLOCK_VEC4: u32 = 9u;

// lo: the 16 x of the low nibbles' sub-block (its `scaled` sum takes off the minimums)
fn q4k_x(x: u32, u: u32) -> X8x2 {
    let t = u & 7u;
    let at = 16u * (u >> 3u) + 4u * (t >> 1u) + (t & 1u);  // the unit's first block of 16 x
    return x8x2(x, at, at + 2u);
}

// (scale of sub-block 2c, its min, scale of 2c + 1, its min) from the block's first vec4:
// quant/q4_k.wgsl's q4k_scale_min for two neighbouring sub-blocks at once, both bytes in one u32.
fn q4k_scales_mins(head: vec4<u32>, c: u32) -> vec4<f32> {
    let shift = 16u * (c & 1u);
    let a = head.y >> shift;
    let b = head.z >> shift;
    let e = head.w >> shift;
    let high = c >= 2u;
    let sc = select(a & 0x3F3Fu, (e & 0x0F0Fu) | ((a >> 2u) & 0x3030u), high);
    let mn = select(b & 0x3F3Fu, ((e >> 4u) & 0x0F0Fu) | ((b >> 2u) & 0x3030u), high);
    return as_floats(vec4<u32>(sc, mn, sc >> 8u, mn >> 8u) & vec4<u32>(0xFFu));
}

// d sc (q . x) - dmin m sum(x), for both sub-blocks of unit t of one row, their quants as bytes
// (lo: sub-block 2c's, hi: 2c + 1's; Q5_K's with their fifth bits)
fn q4k_dot(head: vec4<u32>, lo: vec4<u32>, hi: vec4<u32>, t: u32, x: X8x2) -> f32 {
    let d = unpack2x16float(head.x);
    let sm = q4k_scales_mins(head, t >> 1u);
    let lo_sum = x.lo.step * int_float(dot4(lo, x.lo.q));
    let hi_sum = x.hi.step * int_float(dot4(hi, x.hi.q));
    return d.x * (sm.x * lo_sum + sm.z * hi_sum) - d.y * (sm.y * x.lo.scaled + sm.w * x.hi.scaled);
}

// q4k_dot of quant vec4 q
fn q4k_quad_dot(head: vec4<u32>, q: vec4<u32>, t: u32, x: X8x2) -> f32 {
    return q4k_dot(head, low_nibbles(q), high_nibbles(q), t, x);
}

// unit u of the 4 rows whose first words are `rows`
fn q4k_rows(rows: vec4<u32>, u: u32, x: X8x2) -> vec4<f32> {
    let t = u & 7u;
    let b = rows / 4u + vec4<u32>((u >> 3u) * Q4K_BLOCK_VEC4);
    // all 8 loads first, so that they are in flight together
    let h0 = quad_at(b.x);
    let h1 = quad_at(b.y);
    let h2 = quad_at(b.z);
    let h3 = quad_at(b.w);
    let q0 = quad_at(b.x + 1u + t);
    let q1 = quad_at(b.y + 1u + t);
    let q2 = quad_at(b.z + 1u + t);
    let q3 = quad_at(b.w + 1u + t);
    return vec4<f32>(q4k_quad_dot(h0, q0, t, x), q4k_quad_dot(h1, q1, t, x), q4k_quad_dot(h2, q2, t, x),
                     q4k_quad_dot(h3, q3, t, x));
}
