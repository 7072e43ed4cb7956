// The weights of a gemv unit read as vec4 of words (blocks and rows 16-byte aligned), and the f32
// norm weight from them.

@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;

fn norm_vec4(i: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(W[P.norm_w / 4u + i]);
}

// vec4 i of the weights (words 4i..4i+3)
fn quad_at(i: u32) -> vec4<u32> {
    return W[i];
}
