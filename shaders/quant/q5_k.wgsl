// Q5_K: 256 elements in 8 sub-blocks of 32; element = (d * sc) * q - (dmin * m), q = nibble | bit << 4.
// Block as in the file, 44 words: [0] d (low half) and dmin (high half) as f16 |
// [1..3] 12 bytes of packed scales and mins (as Q4_K) | [4..11] qh: 32 bytes, bit s of byte j is the
// fifth bit of element j of sub-block s | [12..43] 128 quant bytes laid out as in Q4_K.
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 256u;
const BLOCK_WORDS: u32 = 44u;

#include "quant/k_scales.wgsl"

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let dm = k_scaled(blk, i);
    let sub = i >> 3u;
    let w = W[blk + 12u + (i >> 4u) * 8u + (i & 7u)];
    let low = (vec4<u32>(w) >> vec4<u32>((sub & 1u) * 4u) + vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xFu);
    let qh = W[blk + 4u + (i & 7u)];  // bit sub of byte j: the fifth bit of element j of the sub-block
    let high = (vec4<u32>(qh) >> vec4<u32>(sub, sub + 8u, sub + 16u, sub + 24u)) & vec4<u32>(1u);
    return dm.x * vec4<f32>(low | (high << vec4<u32>(4u))) - dm.y;
}
