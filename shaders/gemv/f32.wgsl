// gemv.wgsl's unit for F32: 16 weights, four vec4 of a row. W is bound as vec4: rows of a multiple
// of 4 weights are 16-byte aligned.

#include "gemv/quads.wgsl"
#include "gemv/x_float.wgsl"

const UNIT: u32 = 16u;
alias XU = X16;

fn unit_x(x: u32, u: u32) -> XU {
    return x16(x, 4u * u);
}

// the unit's weights of the row whose unit starts at vec4 b, as matrix columns
fn f32_load(b: u32) -> mat4x4<f32> {
    return mat4x4<f32>(bitcast<vec4<f32>>(W[b]), bitcast<vec4<f32>>(W[b + 1u]), bitcast<vec4<f32>>(W[b + 2u]),
                       bitcast<vec4<f32>>(W[b + 3u]));
}

fn unit_dot(w: mat4x4<f32>, x: X16) -> f32 {
    let acc = w[0] * x.v[0] + w[1] * x.v[1] + w[2] * x.v[2] + w[3] * x.v[3];
    return dot(acc, vec4<f32>(1.0));
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    let b = rows / 4u + vec4<u32>(4u * u);
    // all 16 loads first, so that they are in flight together
    let w0 = f32_load(b.x);
    let w1 = f32_load(b.y);
    let w2 = f32_load(b.z);
    let w3 = f32_load(b.w);
    return vec4<f32>(unit_dot(w0, x), unit_dot(w1, x), unit_dot(w2, x), unit_dot(w3, x));
}
