// gemv.wgsl's unit for BF16 (gemv/halves.wgsl): a bfloat16 is the high half of an f32, so decoding
// only moves bits.

#include "gemv/halves.wgsl"

// the 2 bfloat16 of each of two words as 4 floats
fn halves4(a: u32, b: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
}
