// Q4_K: 256 elements in 8 sub-blocks of 32; element = (d * sc) * q - (dmin * m), q a 4-bit nibble,
// sc and m the 6-bit scale and min of its sub-block.
// Block as in the file, 36 words: [0] d (low half) and dmin (high half) as f16 |
// [1..3] 12 bytes of packed scales and mins | [4..35] 128 quant bytes: 4 chunks of 32 bytes, chunk c
// holding sub-block 2c in its low nibbles and sub-block 2c + 1 in its high nibbles.
// Reads the includer's `W: array<u32>`; see airframe/gpu/quant_layout.py and docs/QUANTIZATION.md.

const QK: u32 = 256u;
const BLOCK_WORDS: u32 = 36u;

fn q4k_byte(word: u32, j: u32) -> u32 {
    return (word >> (8u * j)) & 0xFFu;
}

// (scale, min) of sub-block s: bytes 0-3 hold the scales of 0-3 and bytes 4-7 their mins (low 6 bits);
// sub-blocks 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from the spare bits above.
fn q4k_scale_min(blk: u32, s: u32) -> vec2<u32> {
    let j = s & 3u;
    let a = q4k_byte(W[blk + 1u], j);
    let b = q4k_byte(W[blk + 2u], j);
    if s < 4u {
        return vec2<u32>(a & 63u, b & 63u);
    }
    let c = q4k_byte(W[blk + 3u], j);
    return vec2<u32>((c & 15u) | ((a >> 6u) << 4u), (c >> 4u) | ((b >> 6u) << 4u));
}

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let dmin = unpack2x16float(W[blk]);
    let sub = i >> 3u;
    let sm = q4k_scale_min(blk, sub);
    let w = W[blk + 4u + (i >> 4u) * 8u + (i & 7u)];
    let s = (sub & 1u) * 4u;
    let q = (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(0xFu);
    let d = dmin.x * f32(sm.x);
    let m = dmin.y * f32(sm.y);
    return d * vec4<f32>(q) - m;
}
