// Q4_0: 32 elements = d * (q - 8), q a 4-bit nibble.
// Re-laid block, 5 words: [0] d as f32 | [1..4] the 16 quant bytes of the file, where byte j holds
// element j in its low nibble and element j + 16 in its high nibble.
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;

// Elements 4i..4i+3: word i % 4, low nibbles for i < 4, high nibbles for i >= 4.
fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let d = bitcast<f32>(W[blk]);
    let w = W[blk + 1u + (i & 3u)];
    let s = (i >> 2u) * 4u;
    let q = (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(0xFu);
    return d * (vec4<f32>(q) - 8.0);
}
