// What gemv.wgsl's units for the 16-bit float types (BF16, F16) share: 16 weights, two vec4 of
// words, two halves per word (element 2k in the low half), turned into floats by the type file's
// halves4. W is bound as vec4: rows of a multiple of 16 weights are 16-byte aligned.

#include "gemv/quads.wgsl"
#include "gemv/x_float.wgsl"

const UNIT: u32 = 16u;
alias XU = X16;

fn unit_x(x: u32, u: u32) -> XU {
    return x16(x, 4u * u);
}

fn unit_dot(w0: vec4<u32>, w1: vec4<u32>, x: X16) -> f32 {
    let acc = halves4(w0.x, w0.y) * x.v[0] + halves4(w0.z, w0.w) * x.v[1]
            + halves4(w1.x, w1.y) * x.v[2] + halves4(w1.z, w1.w) * x.v[3];
    return dot(acc, vec4<f32>(1.0));
}

// unit u of the 4 rows starting at words `rows`, dotted with its x
fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    let b = rows / 4u + vec4<u32>(2u * u);
    // all 8 loads first, so that they are in flight together
    let a0 = W[b.x];
    let a1 = W[b.y];
    let a2 = W[b.z];
    let a3 = W[b.w];
    let c0 = W[b.x + 1u];
    let c1 = W[b.y + 1u];
    let c2 = W[b.z + 1u];
    let c3 = W[b.w + 1u];
    return vec4<f32>(unit_dot(a0, c0, x), unit_dot(a1, c1, x), unit_dot(a2, c2, x), unit_dot(a3, c3, x));
}
