// The weights of a gemv unit read as words (blocks that are not 16-byte aligned).

@group(0) @binding(0) var<storage, read> W: array<u32>;

// vec4 i of the weights (words 4i..4i+3)
fn quad_at(i: u32) -> vec4<u32> {
    return vec4<u32>(W[4u * i], W[4u * i + 1u], W[4u * i + 2u], W[4u * i + 3u]);
}
