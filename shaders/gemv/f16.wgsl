// gemv.wgsl's unit for F16 (gemv/halves.wgsl).

#include "gemv/halves.wgsl"

// the 2 halves of each of two words as 4 floats
fn halves4(a: u32, b: u32) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(a), unpack2x16float(b));
}
