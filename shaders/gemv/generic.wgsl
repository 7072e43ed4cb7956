// gemv.wgsl's unit for the types without one of their own: 32 weights decoded 4 at a time by dq4
// of quant/{QUANT}.wgsl (a run of blocks for the float types, a block for the 32-weight types, an
// eighth of a block for the 256-weight ones).

#include "gemv/words.wgsl"
#include "gemv/x_float.wgsl"

#include "quant/{QUANT}.wgsl"

const UNIT: u32 = 32u;

alias XU = X32;

fn unit_x(x: u32, u: u32) -> XU {
    return x32(x, 8u * u, 8u * u + 4u);
}

// weights 4j..4j+3 of unit u of the row starting at word `row`
fn quad(row: u32, u: u32, j: u32) -> vec4<f32> {
    let e = UNIT * u + 4u * j;
    return dq4(row + (e / QK) * BLOCK_WORDS, (e % QK) / 4u);
}

fn unit_dot(row: u32, u: u32, x: XU) -> f32 {
    var acc = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        acc += quad(row, u, j) * x.lo.v[j] + quad(row, u, j + 4u) * x.hi.v[j];
    }
    return dot(acc, vec4<f32>(1.0));
}

fn unit_rows(rows: vec4<u32>, u: u32, x: XU) -> vec4<f32> {
    return vec4<f32>(unit_dot(rows.x, u, x), unit_dot(rows.y, u, x), unit_dot(rows.z, u, x), unit_dot(rows.w, u, x));
}
