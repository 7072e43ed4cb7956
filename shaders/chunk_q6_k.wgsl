// chunk_dot for Q6_K (gemv_chunk.wgsl, CHUNK = 8): chunk j is the 32 weights 32c..32c+31 (c = j % 8)
// of super-block j / 8 (quant/q6_k.wgsl layout): half h = c / 4 and group g = c % 4 of that half take
// ql words 16h + 8(g % 2) + u (nibble g / 2), qh words 8h + u (bits 2g, 2g + 1), and the two signed
// 8-bit scales of sub-blocks 2c and 2c + 1 (word 49 + c / 2, bytes 2(c % 2) and 2(c % 2) + 1).

fn chunk_dot(base: u32, j: u32) -> f32 {
    let blk = base + (j >> 3u) * BLOCK_WORDS;
    let c = j & 7u;
    let h = c >> 2u;
    let g = c & 3u;
    let sl = (g >> 1u) * 4u;
    let sh = g * 2u;
    let ql = blk + 1u + 16u * h + 8u * (g & 1u);
    let qh = blk + 33u + 8u * h;
    var dot_a = vec4<f32>(0.0);
    var dot_b = vec4<f32>(0.0);
    for (var u = 0u; u < 8u; u++) {
        let low = (vec4<u32>(W[ql + u]) >> vec4<u32>(sl, sl + 8u, sl + 16u, sl + 24u)) & vec4<u32>(0xFu);
        let high = (vec4<u32>(W[qh + u]) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(3u);
        let q = vec4<f32>(vec4<i32>(low | (high << vec4<u32>(4u))) - vec4<i32>(32));
        if (u < 4u) {
            dot_a += q * xs[u];
        } else {
            dot_b += q * xs[u];
        }
    }
    let ws = W[blk + 49u + (c >> 1u)];
    let shift = 16u * (c & 1u);
    let sc_a = f32(bitcast<i32>(ws << (24u - shift)) >> 24u);
    let sc_b = f32(bitcast<i32>(ws << (16u - shift)) >> 24u);
    let one = vec4<f32>(1.0);
    return bitcast<f32>(W[blk]) * (sc_a * dot(dot_a, one) + sc_b * dot(dot_b, one));
}
