// gemv.wgsl's unit for Q4_K rows followed by Q6_K rows (Q4_K_M's QKV): gemv/k_q6_k.wgsl.

#include "gemv/quads.wgsl"
#include "gemv/x_int8.wgsl"
#include "gemv/q4_k_rows.wgsl"

fn k_rows(rows: vec4<u32>, u: u32, x: X8x2) -> vec4<f32> {
    return q4k_rows(rows, u, x);
}

#include "gemv/k_q6_k.wgsl"
