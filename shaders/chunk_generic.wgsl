// chunk_dot for any quant type (gemv_chunk.wgsl): chunk j of the row at word `base` dotted with the
// includer's xs, through dq4, 4 weights at a time (each vec4 finds its own block).

fn chunk_dot(base: u32, j: u32) -> f32 {
    let per_block = QK / 4u;
    var acc = vec4<f32>(0.0);
    for (var u = 0u; u < CHUNK; u++) {
        let i = j * CHUNK + u;
        acc += dq4(base + (i / per_block) * BLOCK_WORDS, i % per_block) * xs[u];
    }
    return acc.x + acc.y + acc.z + acc.w;
}
