// gemv.wgsl's unit for Q8_0: half a block, 16 weights. quant/q8_0.wgsl's block is 9 words (d as
// f32, then 32 int8), not 16-byte aligned, so W is read as words; bytes become floats with bit
// operations (bytes_scaled of the bytes plus 128, then 128 sum(x) taken off).

#include "gemv/words.wgsl"

const UNIT: u32 = 16u;
const BLOCK_WORDS: u32 = 9u;
alias XU = X16;

fn unit_x(x: u32, u: u32) -> XU {
    return x16(x, 4u * u, BYTE_SCALE);
}

// d ((q + 128) . x - 128 sum(x)) of one half block
fn unit_dot(d: f32, q: vec4<u32>, x: X16) -> f32 {
    let flip = vec4<u32>(0x80808080u) ^ q;
    let acc = dot(bytes_scaled(flip.x), x.v[0]) + dot(bytes_scaled(flip.y), x.v[1])
            + dot(bytes_scaled(flip.z), x.v[2]) + dot(bytes_scaled(flip.w), x.v[3]);
    return d * (acc - 128.0 * x.sum);
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
    return vec4<f32>(unit_dot(d.x, q0, x), unit_dot(d.y, q1, x), unit_dot(d.z, q2, x), unit_dot(d.w, q3, x));
}
