// What every typed decode matmul (gemv_<type>.wgsl) shares: integers to floats without conversion
// instructions, the partial sums of an invocation, and the end of the kernel (workgroup sums, 1/rms,
// activation, the ROWS outputs). Needs the includer's P, S, Y, const WG and ROWS, activation.wgsl.

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

// An invocation's partial sums: part[r] row r's dot product (the gate's when gated), part[ROWS] the
// x^2 of the x it loaded (for the fused RMSNorm: rmsnorm(x) . w = inv_rms * ((x * norm) . w)),
// part[ROWS + 1 + r] the up projection's dot product of row r when gated.
const N_SUMS: u32 = 2u * ROWS + 1u;
const SQ: u32 = ROWS;
const UP: u32 = ROWS + 1u;
var<private> part: array<f32, N_SUMS>;

#include "gemv_sums_{REDUCE}.wgsl"

// first vec4 of the input row of the workgroup's token
fn x_row(token: u32) -> u32 {
    var x_token = token;
    if ((P.mode & MODE_X_STEP) != 0u) {
        x_token = S.lm_first + token;
    }
    return x_token * P.x_stride / 4u;
}

// Sums `part` over the workgroup; invocation r < ROWS then writes output row row0 + r.
fn finish(lid: u32, row0: u32, token: u32) {
    let is_gated = (P.mode & MODE_GATED) != 0u;
    workgroup_sums(lid, select(ROWS + 1u, N_SUMS, is_gated));
    if (lid >= ROWS || row0 + lid >= P.rows) {
        return;
    }
    var inv = 1.0;
    if ((P.mode & MODE_NORM) != 0u) {
        inv = 1.0 / sqrt(totals[SQ] / f32(P.cols) + P.eps);
    }
    var y = inv * totals[lid];
    if (is_gated) {
        y = gated(P.mode, y, inv * totals[UP + lid]);
    }
    let at = token * P.y_stride + P.y_off + row0 + lid;
    if ((P.mode & MODE_ACCUMULATE) != 0u) {
        Y[at] = Y[at] + y;
    } else {
        Y[at] = y;
    }
}
