// What the decode matmul's units (gemv/<type>.wgsl) share: small integers to floats without
// conversion instructions, and 16 values of x prepared for a unit. Needs the includer's P, S, X, MODE and
// the unit file's quad_at(i) (vec4 i of the weights: gemv/quads.wgsl or gemv/words.wgsl).

// 2^23 as an f32. OR an integer below 2^23 into its mantissa, subtract 2^23, and the result is that
// integer as a float, exactly: two cheap instructions instead of an int-to-float conversion, which
// NVIDIA GPUs run at a quarter of the FMA rate (CUDA C Programming Guide, "Arithmetic Instructions").
const MAGIC: u32 = 0x4B000000u;
const TWO23: f32 = 8388608.0;

fn as_floats(bits: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bits | vec4<u32>(MAGIC)) - vec4<f32>(TWO23);
}

// vec4 i of the f32 norm weight (MODE_NORM; every tensor starts 16-byte aligned)
fn norm_vec4(i: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(quad_at(P.norm_w / 4u + i));
}

// 16 consecutive values of x (4 vec4 as matrix columns) and their sum of squares
struct X16 {
    v: mat4x4<f32>,  // times the norm weight with MODE_NORM
    sq: f32,         // sum of x^2 before the norm weight (rmsnorm(x) . w = inv_rms * ((x * norm) . w))
}

// x vec4 i..i+3 of the row starting at vec4 `row`, times the norm weight (MODE_NORM)
fn x16(row: u32, i: u32) -> X16 {
    var v = mat4x4<f32>(X[row + i], X[row + i + 1u], X[row + i + 2u], X[row + i + 3u]);
    var sq = 0.0;
    if ((MODE & MODE_NORM) != 0u) {
        sq = dot(v[0], v[0]) + dot(v[1], v[1]) + dot(v[2], v[2]) + dot(v[3], v[3]);
        v = mat4x4<f32>(v[0] * norm_vec4(i), v[1] * norm_vec4(i + 1u), v[2] * norm_vec4(i + 2u),
                        v[3] * norm_vec4(i + 3u));
    }
    return X16(v, sq);
}

// first vec4 of the input row of `token` (MODE_X_STEP: the LM head reads position S.lm_first on)
fn x_row(token: u32) -> u32 {
    var x_token = token;
    if ((MODE & MODE_X_STEP) != 0u) {
        x_token = S.lm_first + token;
    }
    return x_token * P.x_stride / 4u;
}
