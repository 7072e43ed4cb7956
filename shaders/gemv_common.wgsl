// What every typed decode matmul (gemv_<type>.wgsl) shares: integers to floats without conversion
// instructions, a unit's x, and the end of the kernel (workgroup sums, 1/rms, activation, the 4
// outputs). Needs the includer's P, S, Y, const WG, activation.wgsl and reduce_{REDUCE}.wgsl.
// The typed kernels are written without loops over rows or vec4 indices: loops that index private
// arrays were measured 1.5x slower on the H200 (docs/BENCHMARKS.md, session 3), so each invocation
// makes exactly 4 rows, held in vec4, and a unit's x lives in mat4x4 columns.

const ROWS: u32 = 4u;

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
    v: mat4x4<f32>,  // times the norm weight with MODE_NORM, then times the includer's scale
    sum: f32,        // the plain sum (times the norm weight), for block minimums and offsets
    sq: f32,         // sum of x^2 before the norm weight (the fused RMSNorm: rmsnorm(x) . w = inv_rms * ((x * norm) . w))
}

// x vec4 i..i+3 of the row starting at vec4 `row`, `norm` the 4 norm-weight vec4 (with MODE_NORM), times `scale`
fn x16(row: u32, i: u32, use_norm: bool, norm: mat4x4<f32>, scale: vec4<f32>) -> X16 {
    var v = mat4x4<f32>(X[row + i], X[row + i + 1u], X[row + i + 2u], X[row + i + 3u]);
    var sq = 0.0;
    if (use_norm) {
        sq = dot(v[0], v[0]) + dot(v[1], v[1]) + dot(v[2], v[2]) + dot(v[3], v[3]);
        v = mat4x4<f32>(v[0] * norm[0], v[1] * norm[1], v[2] * norm[2], v[3] * norm[3]);
    }
    let sum = dot(v[0] + v[1] + v[2] + v[3], vec4<f32>(1.0));
    return X16(mat4x4<f32>(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale), sum, sq);
}

// first vec4 of the input row of the workgroup's token
fn x_row(token: u32) -> u32 {
    var x_token = token;
    if ((P.mode & MODE_X_STEP) != 0u) {
        x_token = S.lm_first + token;
    }
    return x_token * P.x_stride / 4u;
}

// What a workgroup makes: its token and the first vec4 of that token's input row, its first
// output row, the fusions P.mode asks for, and the first word of each of its 4 rows (the last row
// repeated past the end; the gate rows when gated) in `a`, of their up-projection rows in `b`.
struct Group {
    token: u32,
    x: u32,
    row0: u32,
    use_norm: bool,
    is_gated: bool,
    a: vec4<u32>,
    b: vec4<u32>,
}

fn group_of(wid: vec3<u32>) -> Group {
    let row0 = wid.x * ROWS;
    let ids = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(P.rows - 1u));
    let a = vec4<u32>(row_base(ids.x), row_base(ids.y), row_base(ids.z), row_base(ids.w));
    return Group(wid.y, x_row(wid.y), row0, (P.mode & MODE_NORM) != 0u, (P.mode & MODE_GATED) != 0u, a,
                 vec4<u32>(P.w1) + ids * P.row_words);
}

// Sums every invocation's dot products (acc_a; acc_b: the up projection when gated) and x^2 (sq)
// over the workgroup; invocation r < 4 then writes output row g.row0 + r.
fn finish(acc_a: vec4<f32>, acc_b: vec4<f32>, sq: f32, lid: u32, g: Group) {
    let row0 = g.row0;
    reduce_three(acc_a, acc_b, sq, lid);
    if (lid >= ROWS || row0 + lid >= P.rows) {
        return;
    }
    var inv = 1.0;
    if (g.use_norm) {
        inv = 1.0 / sqrt(sum_c[0] / f32(P.cols) + P.eps);
    }
    var y = inv * sum_a[0][lid];
    if (g.is_gated) {
        y = gated(P.mode, y, inv * sum_b[0][lid]);
    }
    let at = g.token * P.y_stride + P.y_off + row0 + lid;
    if ((P.mode & MODE_ACCUMULATE) != 0u) {
        Y[at] = Y[at] + y;
    } else {
        Y[at] = y;
    }
}
