// gemv.wgsl's unit for Q4_K: one quant vec4 of a block, 32 weights: 16 of sub-block 2c in its low
// nibbles and 16 of sub-block 2c + 1 in its high nibbles (c = t / 2, t = u % 8), so 8 units share a
// super-block. quant/q4_k.wgsl's 144-byte block is 9 vec4: [0] d, dmin (f16) and the 12 bytes of
// 6-bit scales and mins, [1 + t] quant bytes 16t..16t+15. The unit's x is rounded to 8 bits
// (gemv/x_int8.wgsl) and each quant word's nibbles, masked into bytes, are dotted with it four at a
// time; the minimums come off the rounded x's sum, so a row's sum is the exact product of its
// weights with the rounded x. W is bound as vec4 (blocks and rows are 16-byte aligned).

#include "gemv/quads.wgsl"
#include "gemv/x_int8.wgsl"

const UNIT: u32 = 32u;
const BLOCK_VEC4: u32 = 9u;

struct XU {
    lo: X8,  // the 16 x of the low nibbles' sub-block (its `scaled` sum takes off the minimums)
    hi: X8,
    sq: f32,
}

fn unit_x(x: u32, u: u32) -> XU {
    let t = u & 7u;
    let at = 16u * (u >> 3u) + 4u * (t >> 1u) + (t & 1u);  // the unit's first block of 16 x
    let lo = x8(x, at);
    let hi = x8(x, at + 2u);
    return XU(lo, hi, lo.sq + hi.sq);
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

// d sc (q . x) - dmin m sum(x), for both sub-blocks of unit t of one row
fn unit_dot(head: vec4<u32>, q: vec4<u32>, t: u32, x: XU) -> f32 {
    let d = unpack2x16float(head.x);
    let sm = scales_mins(head, t >> 1u);
    let lo = int_float(dot4(q & vec4<u32>(0x0F0F0F0Fu), x.lo.q));
    let hi = int_float(dot4((q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu), x.hi.q));
    return d.x * (sm.x * x.lo.step * lo + sm.z * x.hi.step * hi)
         - d.y * (sm.y * x.lo.scaled + sm.w * x.hi.scaled);
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    let t = u & 7u;
    let b = rows / 4u + vec4<u32>((u >> 3u) * BLOCK_VEC4);
    // all 8 loads first, so that they are in flight together
    let h0 = W[b.x];
    let h1 = W[b.y];
    let h2 = W[b.z];
    let h3 = W[b.w];
    let q0 = W[b.x + 1u + t];
    let q1 = W[b.y + 1u + t];
    let q2 = W[b.z + 1u + t];
    let q3 = W[b.w + 1u + t];
    return vec4<f32>(unit_dot(h0, q0, t, x), unit_dot(h1, q1, t, x), unit_dot(h2, q2, t, x), unit_dot(h3, q3, t, x));
}
