// What gemv.wgsl's units for a K-quant's rows followed by Q6_K rows in one output share (a _K_M
// file's attn_q and attn_k with a Q6_K attn_v): rows from P.seg2 on are Q6_K, with P.row_words2
// words a row. Each quad of rows lies on one side (the segments start at multiples of 4), so a
// subgroup runs one type's unit (gemv.wgsl's quad_row says which). W is bound as vec4 (every
// type's rows are 16-byte aligned). Needs the includer's k_rows (the first type's rows, whose x is
// Q4_K's).

#include "gemv/q6_k_rows.wgsl"

const UNIT: u32 = 32u;

alias XU = X8x2;

fn unit_x(x: u32, u: u32) -> XU {
    if (quad_row >= P.seg2) {
        return q6k_x(x, u);
    }
    return q4k_x(x, u);
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    if (quad_row >= P.seg2) {
        return q6k_rows(rows, u, x);
    }
    return k_rows(rows, u, x);
}
