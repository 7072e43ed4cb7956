// gemv.wgsl's x for the units of the quantized types: each token's x rounded to 8 bits for
// dot4I8Packed, one step per 16 values (their largest magnitude / 127), so a product of weights and
// x is exact up to x's rounding, about 4e-3 of the largest output (tests/test_gpu_matmul.py).
// With STAGE_X the workgroup rounds x once, XBLOCKS blocks of 16 values per token at a time, into
// workgroup memory, where every quad's units read it: for workgroups of 4 quads or more, which
// would otherwise round each block once per quad. With one or two quads a workgroup has nothing to
// share, and each unit rounds its own blocks as it goes (no barrier, no wait for the rounding).
// The float to integer rounding adds 1.5 * 2^23, which leaves the rounded integer in the low bits,
// and the integer sums come back as floats through the same constant: no conversion instructions.

const INT8_X: u32 = 1u;
const STAGE_X: u32 = {GEMV_STAGE_X}u;
const XBLOCKS: u32 = {GEMV_XBLOCKS}u;  // blocks of 16 values staged per token: a multiple of 16, or 1
const ROUND: f32 = 12582912.0;
const ROUND_BITS: i32 = 0x4B400000;
const ONES: u32 = 0x01010101u;

// token t's block b of the chunk at t * XBLOCKS + b: its 16 values as packed int8 (value 4c + e in
// byte e of word c), and (step, step * sum, sum of squares before the norm weight, sum as i32 bits)
var<workgroup> x_q: array<vec4<u32>, TOKENS * XBLOCKS>;
var<workgroup> x_s: array<vec4<f32>, TOKENS * XBLOCKS>;

struct X8 {
    q: vec4<u32>,  // the 16 values as packed int8
    step: f32,     // what one integer step is worth
    sum: i32,      // the sum of the 16 integers
    scaled: f32,   // step * sum
    sq: f32,       // the sum of squares of the 16 values before the norm weight (MODE_NORM)
}

// the x of a K-quant unit: two runs of 16 (each against one sub-block's quants)
struct X8x2 {
    lo: X8,
    hi: X8,
    sq: f32,
}

fn chunk_units(n_units: u32) -> u32 {
    if (STAGE_X == 0u) {
        return n_units;
    }
    return XBLOCKS * 16u / UNIT;
}

// blocks u0 * UNIT / 16 .. + XBLOCKS of the group's tokens' x, rounded into x_q and x_s
fn stage_x(first_token: u32, n_tokens: u32, u0: u32, lid: u32) {
    if (STAGE_X == 0u) {
        return;
    }
    let block0 = u0 * UNIT / 16u;
    let n = min(XBLOCKS, P.cols / 16u - block0);
    for (var i = lid; i < TOKENS * XBLOCKS; i += WG) {
        let t = i / XBLOCKS;
        let b = i % XBLOCKS;
        if (t < n_tokens && b < n) {
            let r = rounded16(x_row(first_token + t), block0 + b);
            x_q[i] = r.q;
            x_s[i] = vec4<f32>(r.step, r.scaled, r.sq, bitcast<f32>(r.sum));
        }
    }
    workgroupBarrier();
}

// where token t's x is: staged, where its blocks of the chunk from unit u0 start (the unit adds a
// block's index in the row); else its row of X
fn token_x(t: u32, first_token: u32, u0: u32) -> u32 {
    if (STAGE_X == 0u) {
        return x_row(first_token + t);
    }
    return t * XBLOCKS - u0 * UNIT / 16u;  // wraps around; the sum with a block of the chunk does not
}

// block b (values 16b..16b+15) of the row at `x` (token_x)
fn x8(x: u32, b: u32) -> X8 {
    if (STAGE_X == 0u) {
        return rounded16(x, b);
    }
    let s = x_s[x + b];
    return X8(x_q[x + b], s.x, bitcast<i32>(s.w), s.y, s.z);
}

// the x of a K-quant unit: blocks lo and hi of the row at `x` (token_x)
fn x8x2(x: u32, lo: u32, hi: u32) -> X8x2 {
    let a = x8(x, lo);
    let b = x8(x, hi);
    return X8x2(a, b, a.sq + b.sq);
}

// block b of the row of X at vec4 `row`, rounded
fn rounded16(row: u32, b: u32) -> X8 {
    let v = x16(row, 4u * b);
    let m = max(max(abs(v.v[0]), abs(v.v[1])), max(abs(v.v[2]), abs(v.v[3])));
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    let inv = select(127.0 / amax, 0.0, amax == 0.0);
    let q = vec4<u32>(rounded(v.v[0] * inv), rounded(v.v[1] * inv), rounded(v.v[2] * inv), rounded(v.v[3] * inv));
    let sum = dot4(q, vec4<u32>(ONES));
    let step = amax / 127.0;
    return X8(q, step, sum, step * int_float(sum), v.sq);
}

// 4 values already scaled to at most 127 in magnitude, rounded and packed as int8
fn rounded(v: vec4<f32>) -> u32 {
    return pack4xI8(bitcast<vec4<i32>>(v + ROUND));
}

// the 16 products of two packed vectors, summed
fn dot4(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// the low and high nibbles of 16 quant bytes, each as a byte
fn low_nibbles(q: vec4<u32>) -> vec4<u32> {
    return q & vec4<u32>(0x0F0F0F0Fu);
}

fn high_nibbles(q: vec4<u32>) -> vec4<u32> {
    return (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
}

// an integer of magnitude below 2^22 as a float
fn int_float(i: i32) -> f32 {
    return bitcast<f32>(i + ROUND_BITS) - ROUND;
}
