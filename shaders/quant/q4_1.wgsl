// Q4_1: 32 elements = d * q + m, q a 4-bit nibble.
// Block as in the file, 5 words: [0] d (low half) and m (high half) as f16 | [1..4] 16 quant bytes,
// byte j holding element j in its low nibble and element j + 16 in its high nibble.
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let dm = unpack2x16float(W[blk]);
    let w = W[blk + 1u + (i & 3u)];
    let s = (i >> 2u) * 4u;
    let q = (vec4<u32>(w) >> vec4<u32>(s, s + 8u, s + 16u, s + 24u)) & vec4<u32>(0xFu);
    return dm.x * vec4<f32>(q) + dm.y;
}
