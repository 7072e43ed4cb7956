// Q5_K: 256 elements in 8 sub-blocks of 32; element = (d * sc) * q - (dmin * m), q = nibble | bit << 4.
// Block as in the file, 44 words: [0] d (low half) and dmin (high half) as f16 |
// [1..3] 12 bytes of packed scales and mins (as Q4_K) | [4..11] qh: 32 bytes, bit s of byte j is the
// fifth bit of element j of sub-block s | [12..43] 128 quant bytes laid out as in Q4_K.
// Reads the includer's `W: array<u32>`; see airframe/gpu/quant_layout.py and docs/QUANTIZATION.md.

const QK: u32 = 256u;
const BLOCK_WORDS: u32 = 44u;

fn q5k_byte(word: u32, j: u32) -> u32 {
    return (word >> (8u * j)) & 0xFFu;
}

// (scale, min) of sub-block s, packed as in Q4_K.
fn q5k_scale_min(blk: u32, s: u32) -> vec2<u32> {
    let j = s & 3u;
    let a = q5k_byte(W[blk + 1u], j);
    let b = q5k_byte(W[blk + 2u], j);
    if s < 4u {
        return vec2<u32>(a & 63u, b & 63u);
    }
    let c = q5k_byte(W[blk + 3u], j);
    return vec2<u32>((c & 15u) | ((a >> 6u) << 4u), (c >> 4u) | ((b >> 6u) << 4u));
}

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let dmin = unpack2x16float(W[blk]);
    let sub = i >> 3u;
    let sm = q5k_scale_min(blk, sub);
    let w = W[blk + 12u + (i >> 4u) * 8u + (i & 7u)];
    let s = (sub & 1u) * 4u;
    let low = (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(0xFu);
    let qh = W[blk + 4u + (i & 7u)];
    let high = (vec4<u32>(qh) >> vec4<u32>(sub, sub + 8u, sub + 16u, sub + 24u)) & vec4<u32>(1u);
    let d = dmin.x * f32(sm.x);
    let m = dmin.y * f32(sm.y);
    return d * vec4<f32>(low | (high << vec4<u32>(4u))) - m;
}
