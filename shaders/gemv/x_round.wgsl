// 16 values of x rounded to 8 bits for dot4I8Packed, one step per 16 values (their largest
// magnitude / 127): how the quantized types' gemv units read x (gemv/x_int8.wgsl), and how a gated
// gemv writes its output for the matmul that reads it next (gemv.wgsl's MODE_ROUND_OUT). Both store
// a rounded block as two vec4: the 16 int8 packed (value 4c + e in byte e of word c), then (step,
// step * sum, sum of squares before the norm weight, sum as i32 bits); one function rounds for both,
// so the matmul reading a stored block sums what it would have rounded itself.
// The float to integer rounding adds 1.5 * 2^23, which leaves the rounded integer in the low bits,
// and the integer sums come back as floats through the same constant: no conversion instructions.

const ROUND: f32 = 12582912.0;
const ROUND_BITS: i32 = 0x4B400000;
const ONES: u32 = 0x01010101u;

struct X8 {
    q: vec4<u32>,  // the 16 values as packed int8
    step: f32,     // what one integer step is worth
    sum: i32,      // the sum of the 16 integers
    scaled: f32,   // step * sum
    sq: f32,       // the sum of squares of the 16 values before the norm weight (MODE_NORM)
}

// the 16 values of v rounded
fn round16(v: X16) -> X8 {
    let m = max(max(abs(v.v[0]), abs(v.v[1])), max(abs(v.v[2]), abs(v.v[3])));
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    let inv = select(127.0 / amax, 0.0, amax == 0.0);
    let q = vec4<u32>(rounded(v.v[0] * inv), rounded(v.v[1] * inv), rounded(v.v[2] * inv), rounded(v.v[3] * inv));
    let sum = dot4(q, vec4<u32>(ONES));
    let step = amax / 127.0;
    return X8(q, step, sum, step * int_float(sum), v.sq);
}

// the second vec4 of a stored block
fn x8_scales(x: X8) -> vec4<f32> {
    return vec4<f32>(x.step, x.scaled, x.sq, bitcast<f32>(x.sum));
}

// a stored block back from its two vec4
fn stored_x8(q: vec4<u32>, s: vec4<f32>) -> X8 {
    return X8(q, s.x, bitcast<i32>(s.w), s.y, s.z);
}

// 4 values already scaled to at most 127 in magnitude, rounded and packed as int8
fn rounded(v: vec4<f32>) -> u32 {
    return pack4xI8(bitcast<vec4<i32>>(v + ROUND));
}

// the 16 products of two packed vectors, summed
fn dot4(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// an integer of magnitude below 2^22 as a float
fn int_float(i: i32) -> f32 {
    return bitcast<f32>(i + ROUND_BITS) - ROUND;
}
