// Q5_0: 32 elements = d * (q - 16), q = 4-bit nibble | fifth bit << 4.
// Re-laid block, 6 words: [0] d as f32 | [1] qh, bit j = fifth bit of element j |
// [2..5] 16 quant bytes, byte j holding element j (low nibble) and element j + 16 (high nibble).
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 32u;
const BLOCK_WORDS: u32 = 6u;

#include "quant/q5_bits.wgsl"

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let d = bitcast<f32>(W[blk]);
    let qh = W[blk + 1u];
    let w = W[blk + 2u + (i & 3u)];
    return d * (q5_quads(qh, w, i) - 16.0);
}
