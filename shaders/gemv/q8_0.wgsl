// gemv.wgsl's unit for Q8_0: half a block, 16 weights. quant/q8_0.wgsl's block is 9 words (d as
// f32, then 32 int8), not 16-byte aligned, so W is read as words. The unit's x, rounded to 8 bits
// (gemv/x_int8.wgsl), is dotted with the quants four at a time.

#include "gemv/words.wgsl"
#include "gemv/x_int8.wgsl"

const UNIT: u32 = 16u;
const BLOCK_WORDS: u32 = 9u;

struct XU {
    x: X8,
    sq: f32,
}

fn unit_x(x: u32, u: u32) -> XU {
    let v = x8(x, u);
    return XU(v, v.sq);
}

fn quants(first: u32) -> vec4<u32> {
    return vec4<u32>(W[first], W[first + 1u], W[first + 2u], W[first + 3u]);
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    let b = rows + vec4<u32>((u >> 1u) * BLOCK_WORDS);
    let q = 1u + 4u * (u & 1u);
    // all loads first, so that they are in flight together
    let d = vec4<f32>(bitcast<f32>(W[b.x]), bitcast<f32>(W[b.y]), bitcast<f32>(W[b.z]), bitcast<f32>(W[b.w]));
    let q0 = quants(b.x + q);
    let q1 = quants(b.y + q);
    let q2 = quants(b.z + q);
    let q3 = quants(b.w + q);
    let sums = vec4<f32>(int_float(dot4(q0, x.x.q)), int_float(dot4(q1, x.x.q)), int_float(dot4(q2, x.x.q)),
                         int_float(dot4(q3, x.x.q)));
    return d * x.x.step * sums;
}
