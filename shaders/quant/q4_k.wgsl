// Q4_K: 256 elements in 8 sub-blocks of 32; element = (d * sc) * q - (dmin * m), q a 4-bit nibble,
// sc and m the 6-bit scale and min of its sub-block.
// Block as in the file, 36 words: [0] d (low half) and dmin (high half) as f16 |
// [1..3] 12 bytes of packed scales and mins | [4..35] 128 quant bytes: 4 chunks of 32 bytes, chunk c
// holding sub-block 2c in its low nibbles and sub-block 2c + 1 in its high nibbles.
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 256u;
const BLOCK_WORDS: u32 = 36u;

#include "quant/k_scales.wgsl"

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let dm = k_scaled(blk, i);
    let w = W[blk + 4u + (i >> 4u) * 8u + (i & 7u)];
    let s = ((i >> 3u) & 1u) * 4u;  // sub-block 2c in the low nibbles, 2c + 1 in the high
    let q = (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(0xFu);
    return dm.x * vec4<f32>(q) - dm.y;
}
