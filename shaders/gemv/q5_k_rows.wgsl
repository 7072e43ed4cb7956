// Q5_K rows for gemv.wgsl's units (gemv/q5_k.wgsl, gemv/q5_k_q6_k.wgsl): one quant vec4 of a block,
// 32 weights, as Q4_K's (gemv/q4_k_rows.wgsl: the same scales, quant layout and x, q4k_x).
// quant/q5_k.wgsl's 176-byte block is 11 vec4: [0] d, dmin and the scales, [1..2] qh, [3 + t]
// quant bytes 16t..16t+15. Unit t's weights are elements 16 (t % 2) .. +15 of sub-blocks 2c and
// 2c + 1 (c = t / 2), so their fifth bits are bits 2c and 2c + 1 of qh bytes 16 (t % 2) .. +15: qh
// vec4 1 + t % 2. Each byte's bit is moved to bit 4 above its nibble, and the 5-bit quants are
// dotted as Q4_K's are. The weights are read as vec4 through the includer's quad_at.

#include "gemv/q4_k_rows.wgsl"

const Q5K_BLOCK_VEC4: u32 = 11u;

// bit `bit` of each of the 16 qh bytes, at bit 4 of its byte
fn q5k_fifth_bits(qh: vec4<u32>, bit: u32) -> vec4<u32> {
    return ((qh >> vec4<u32>(bit)) & vec4<u32>(ONES)) << vec4<u32>(4u);
}

fn q5k_dot(head: vec4<u32>, qh: vec4<u32>, q: vec4<u32>, t: u32, x: X8x2) -> f32 {
    let c = t >> 1u;
    let lo = low_nibbles(q) | q5k_fifth_bits(qh, 2u * c);
    let hi = high_nibbles(q) | q5k_fifth_bits(qh, 2u * c + 1u);
    return q4k_dot(head, lo, hi, t, x);
}

// unit u of the 4 rows whose first words are `rows`
fn q5k_rows(rows: vec4<u32>, u: u32, x: X8x2) -> vec4<f32> {
    let t = u & 7u;
    let b = rows / 4u + vec4<u32>((u >> 3u) * Q5K_BLOCK_VEC4);
    // all 12 loads first, so that they are in flight together
    let h0 = quad_at(b.x);
    let h1 = quad_at(b.y);
    let h2 = quad_at(b.z);
    let h3 = quad_at(b.w);
    let e = 1u + (t & 1u);
    let e0 = quad_at(b.x + e);
    let e1 = quad_at(b.y + e);
    let e2 = quad_at(b.z + e);
    let e3 = quad_at(b.w + e);
    let q0 = quad_at(b.x + 3u + t);
    let q1 = quad_at(b.y + 3u + t);
    let q2 = quad_at(b.z + 3u + t);
    let q3 = quad_at(b.w + 3u + t);
    return vec4<f32>(q5k_dot(h0, e0, q0, t, x), q5k_dot(h1, e1, q1, t, x), q5k_dot(h2, e2, q2, t, x),
                     q5k_dot(h3, e3, q3, t, x));
}
