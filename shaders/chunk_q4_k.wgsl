// chunk_dot for Q4_K (gemv_chunk.wgsl, CHUNK = 16): chunk j is the 64 weights of quant chunk c = j % 4
// of super-block j / 4 (quant/q4_k.wgsl layout): sub-block 2c in the low nibbles and 2c + 1 in the
// high nibbles of the same 8 words. d, dmin and the two (scale, min) pairs are decoded once;
// sum((d sc q - dmin m) x) = d sc (q . x) - dmin m sum(x), per sub-block.

fn chunk_dot(base: u32, j: u32) -> f32 {
    let blk = base + (j >> 2u) * BLOCK_WORDS;
    let c = j & 3u;
    let dmin = unpack2x16float(W[blk]);
    let sm_lo = q4k_scale_min(blk, 2u * c);
    let sm_hi = q4k_scale_min(blk, 2u * c + 1u);
    var dot_lo = vec4<f32>(0.0);
    var dot_hi = vec4<f32>(0.0);
    var x_lo = vec4<f32>(0.0);
    var x_hi = vec4<f32>(0.0);
    for (var k = 0u; k < 8u; k++) {
        let w = vec4<u32>(W[blk + 4u + 8u * c + k]);
        let q_lo = vec4<f32>((w >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xFu));
        let q_hi = vec4<f32>((w >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(0xFu));
        dot_lo += q_lo * xs[k];
        dot_hi += q_hi * xs[k + 8u];
        x_lo += xs[k];
        x_hi += xs[k + 8u];
    }
    let one = vec4<f32>(1.0);
    return dmin.x * (f32(sm_lo.x) * dot(dot_lo, one) + f32(sm_hi.x) * dot(dot_hi, one))
         - dmin.y * (f32(sm_lo.y) * dot(x_lo, one) + f32(sm_hi.y) * dot(x_hi, one));
}
