// 16 values of a unit's x rounded to 8 bits for dot4I8Packed (the units of the 8-bit and K-quant
// types): one step per 16 values (their largest magnitude / 127), so a product of weights and x is
// exact up to x's rounding, about 4e-3 of the largest output (tests/test_gpu_matmul.py). The float
// to integer rounding adds 1.5 * 2^23, which leaves the rounded integer in the low bits, and the
// integer sums come back as floats through the same constant: no conversion instructions.

const ROUND: f32 = 12582912.0;
const ROUND_BITS: i32 = 0x4B400000;
const ONES: u32 = 0x01010101u;

struct X8 {
    q: vec4<u32>,  // the 16 values as packed int8, value 4c + b in byte b of word c
    step: f32,     // what one integer step is worth
    sum: i32,      // the sum of the 16 integers
}

fn x8(v: mat4x4<f32>) -> X8 {
    let m = max(max(abs(v[0]), abs(v[1])), max(abs(v[2]), abs(v[3])));
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    let inv = select(127.0 / amax, 0.0, amax == 0.0);
    let q = vec4<u32>(pack4xI8(bitcast<vec4<i32>>(v[0] * inv + ROUND)), pack4xI8(bitcast<vec4<i32>>(v[1] * inv + ROUND)),
                      pack4xI8(bitcast<vec4<i32>>(v[2] * inv + ROUND)), pack4xI8(bitcast<vec4<i32>>(v[3] * inv + ROUND)));
    return X8(q, amax / 127.0, dot4(q, vec4<u32>(ONES)));
}

// the 16 products of two packed vectors, summed
fn dot4(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// an integer of magnitude below 2^22 as a float
fn int_float(i: i32) -> f32 {
    return bitcast<f32>(i + ROUND_BITS) - ROUND;
}
