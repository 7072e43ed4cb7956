// What gemm and gemm_rows share: Params, Step and row_base (matmul_structs.wgsl)
// and norm_weight, which reads W as words.
// Needs the including shader's bindings W (weights, as array<u32>) and P (Params).

#include "matmul_structs.wgsl"

// 4 consecutive floats of the f32 norm weight (MODE_NORM), stored in the layer buffer W
fn norm_weight(i: u32) -> vec4<f32> {
    let o = P.norm_w + 4u * i;
    return vec4<f32>(bitcast<f32>(W[o]), bitcast<f32>(W[o + 1u]), bitcast<f32>(W[o + 2u]), bitcast<f32>(W[o + 3u]));
}
