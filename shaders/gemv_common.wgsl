// What the decode matmul's units (gemv/<type>.wgsl) share: integers to floats without conversion
// instructions, and 16 values of x prepared for a unit. Needs the includer's P, S, X and the unit
// file's norm_vec4(i) (vec4 i of the f32 norm weight).

// 2^23 as an f32. OR an integer below 2^23 into its mantissa, subtract 2^23, and the result is that
// integer as a float, exactly: two cheap instructions instead of an int-to-float conversion, which
// NVIDIA GPUs run at a quarter of the FMA rate (CUDA C Programming Guide, "Arithmetic Instructions").
const MAGIC: u32 = 0x4B000000u;
const TWO23: f32 = 8388608.0;

fn as_floats(bits: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bits | vec4<u32>(MAGIC)) - vec4<f32>(TWO23);
}

// The 4 bytes of w as floats times (1, 256, 1, 256): bytes 0 and 2 at bit 0, 1 and 3 at bit 8.
// The includer pre-multiplies x by BYTE_SCALE instead of shifting each byte down.
const BYTE_SCALE = vec4<f32>(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);

fn bytes_scaled(w: u32) -> vec4<f32> {
    return as_floats(vec4<u32>(w, w, w >> 16u, w >> 16u) & vec4<u32>(0xFFu, 0xFF00u, 0xFFu, 0xFF00u));
}

// 16 consecutive values of x (4 vec4 as matrix columns) and what the quant formulas need of them
struct X16 {
    v: mat4x4<f32>,  // times the norm weight with MODE_NORM, then times the unit's scale
    sum: f32,        // the plain sum (times the norm weight), for block minimums and offsets
    sq: f32,         // sum of x^2 before the norm weight (rmsnorm(x) . w = inv_rms * ((x * norm) . w))
}

// x vec4 i..i+3 of the row starting at vec4 `row`, times the norm weight (MODE_NORM), times `scale`
fn x16(row: u32, i: u32, scale: vec4<f32>) -> X16 {
    var v = mat4x4<f32>(X[row + i], X[row + i + 1u], X[row + i + 2u], X[row + i + 3u]);
    var sq = 0.0;
    if ((P.mode & MODE_NORM) != 0u) {
        sq = dot(v[0], v[0]) + dot(v[1], v[1]) + dot(v[2], v[2]) + dot(v[3], v[3]);
        v = mat4x4<f32>(v[0] * norm_vec4(i), v[1] * norm_vec4(i + 1u), v[2] * norm_vec4(i + 2u),
                        v[3] * norm_vec4(i + 3u));
    }
    let sum = dot(v[0] + v[1] + v[2] + v[3], vec4<f32>(1.0));
    return X16(mat4x4<f32>(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale), sum, sq);
}

// 32 values of x as two runs of 16 (at vec4 lo and hi), and their sum of squares
struct X32 {
    lo: X16,
    hi: X16,
    sq: f32,
}

fn x32(row: u32, lo: u32, hi: u32, scale_lo: vec4<f32>, scale_hi: vec4<f32>) -> X32 {
    let a = x16(row, lo, scale_lo);
    let b = x16(row, hi, scale_hi);
    return X32(a, b, a.sq + b.sq);
}

// first vec4 of the input row of `token` (MODE_X_STEP: the LM head reads position S.lm_first on)
fn x_row(token: u32) -> u32 {
    var x_token = token;
    if ((P.mode & MODE_X_STEP) != 0u) {
        x_token = S.lm_first + token;
    }
    return x_token * P.x_stride / 4u;
}
