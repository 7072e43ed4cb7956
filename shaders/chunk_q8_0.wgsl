// chunk_dot for Q8_0 (gemv_chunk.wgsl, CHUNK = 8): chunk j is block j of the row (quant/q8_0.wgsl
// layout: d as f32, then 8 words of int8), the scale read once per 32 weights.

fn chunk_dot(base: u32, j: u32) -> f32 {
    let blk = base + j * BLOCK_WORDS;
    var acc = vec4<f32>(0.0);
    for (var u = 0u; u < 8u; u++) {
        let w = W[blk + 1u + u];
        let top = vec4<u32>(w << 24u, w << 16u, w << 8u, w);
        acc += vec4<f32>(bitcast<vec4<i32>>(top) >> vec4<u32>(24u)) * xs[u];
    }
    return bitcast<f32>(W[blk]) * (acc.x + acc.y + acc.z + acc.w);
}
