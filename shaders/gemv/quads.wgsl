// The weights of a gemv unit read as vec4 of words (blocks and rows 16-byte aligned).

@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;

// vec4 i of the weights (words 4i..4i+3)
fn quad_at(i: u32) -> vec4<u32> {
    return W[i];
}

// word i of the weights
fn word_at(i: u32) -> u32 {
    return W[i >> 2u][i & 3u];
}
