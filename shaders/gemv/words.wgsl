// The weights of a gemv unit read as words (blocks that are not 16-byte aligned), and the f32 norm
// weight from them.

@group(0) @binding(0) var<storage, read> W: array<u32>;

fn norm_vec4(i: u32) -> vec4<f32> {
    let o = P.norm_w + 4u * i;
    return bitcast<vec4<f32>>(vec4<u32>(W[o], W[o + 1u], W[o + 2u], W[o + 3u]));
}

// vec4 i of the weights (words 4i..4i+3)
fn quad_at(i: u32) -> vec4<u32> {
    return vec4<u32>(W[4u * i], W[4u * i + 1u], W[4u * i + 2u], W[4u * i + 3u]);
}
