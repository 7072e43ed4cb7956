// gemv.wgsl's unit for Q5_K rows followed by Q6_K rows in one output (Q5_K_M's attn_q and attn_k
// with a Q6_K attn_v), as gemv/q4_k_q6_k.wgsl does for Q4_K_M: rows from P.seg2 on are Q6_K, with
// P.row_words2 words a row, and W is bound as words.

#include "gemv/words.wgsl"
#include "gemv/x_int8.wgsl"
#include "gemv/q5_k_rows.wgsl"
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
    return q5k_rows(rows, u, x);
}
