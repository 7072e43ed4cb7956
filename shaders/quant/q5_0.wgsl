// Q5_0: 32 elements = d * (q - 16), q = 4-bit nibble | fifth bit << 4.
// Re-laid block, 6 words: [0] d as f32 | [1] qh, bit j = fifth bit of element j |
// [2..5] 16 quant bytes, byte j holding element j (low nibble) and element j + 16 (high nibble).
// Reads the includer's `W: array<u32>`; see airframe/gpu/quant_layout.py and docs/QUANTIZATION.md.

const QK: u32 = 32u;
const BLOCK_WORDS: u32 = 6u;

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let d = bitcast<f32>(W[blk]);
    let qh = W[blk + 1u];
    let w = W[blk + 2u + (i & 3u)];
    let s = (i >> 2u) * 4u;
    let low = (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(0xFu);
    let e = 4u * i;
    let high = (vec4<u32>(qh) >> vec4<u32>(e, e + 1u, e + 2u, e + 3u)) & vec4<u32>(1u);
    return d * (vec4<f32>(low | (high << vec4<u32>(4u))) - 16.0);
}
