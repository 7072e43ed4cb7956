// gemv.wgsl's unit for Q6_K: gemv/q6_k_rows.wgsl with W bound as vec4.

#include "gemv/quads.wgsl"
#include "gemv/x_int8.wgsl"
#include "gemv/q6_k_rows.wgsl"

const UNIT: u32 = 32u;

alias XU = X8x2;

fn unit_x(x: u32, u: u32) -> XU {
    return q6k_x(x, u);
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    return q6k_rows(rows, u, x);
}
