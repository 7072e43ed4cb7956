// The uniform block every matmul program reads (Params, Step) and row_base, which needs only P: the
// part of matmul_params.wgsl that programs binding W as array<vec4<u32>> (gemv/quads.wgsl) include
// too. The Python side (airframe/gpu/pipelines.py) reads this one layout from here.

struct Params {
    rows: u32,       // output rows, all segments together
    cols: u32,       // input length
    row_words: u32,  // u32 words per weight row
    mode: u32,       // MODE_* bits from activation.wgsl
    w0: u32,         // word offset of segment 0 (or of the gate weight)
    w1: u32,         // word offset of segment 1 (or of the up weight)
    w2: u32,         // word offset of segment 2
    seg1: u32,       // first row of segment 1 (0xffffffff: none)
    seg2: u32,       // first row of segment 2 (0xffffffff: none)
    norm_w: u32,     // word offset of the f32 norm weight (MODE_NORM)
    eps: f32,
    x_stride: u32,   // floats between two tokens of X
    y_stride: u32,   // floats between two tokens of Y
    y_off: u32,      // first float of this output inside a token's row of Y
    row_words2: u32, // u32 words per weight row of segment 2 (gemv/k_q6_k.wgsl: another type's)
    xq_off: u32,     // gemv.wgsl: first float of the rounded copy, of Y (MODE_ROUND_OUT) or X (STAGE_X 2)
}

#include "step.wgsl"

// first word of output row `row`, across up to three weight segments
fn row_base(row: u32) -> u32 {
    if (row >= P.seg2) {
        return P.w2 + (row - P.seg2) * P.row_words2;
    }
    if (row >= P.seg1) {
        return P.w1 + (row - P.seg1) * P.row_words;
    }
    return P.w0 + row * P.row_words;
}
