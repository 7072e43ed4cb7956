// Q8_0: 32 elements = q * d, q a signed byte.
// Re-laid block, 9 words: [0] d as f32 | [1..8] the 32 int8 quants, element 4k + b in byte b of word 1 + k.
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 32u;
const BLOCK_WORDS: u32 = 9u;

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let d = bitcast<f32>(W[blk]);
    let w = W[blk + 1u + i];
    // move byte b to the top, then an arithmetic shift brings it back sign-extended
    let top = vec4<u32>(w << 24u, w << 16u, w << 8u, w);
    let q = bitcast<vec4<i32>>(top) >> vec4<u32>(24u);
    return vec4<f32>(q) * d;
}
