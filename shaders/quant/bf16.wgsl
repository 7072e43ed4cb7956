// BF16: blocks of 4 bfloat16, two per word, as in the file (element 2k in the low half).
// A bfloat16 is the high half of an f32, so decoding only moves bits (as gguf-py does).
// Reads the includer's `W: array<u32>`; see airframe/quants.py, airframe/gpu/pack.py and docs/QUANTIZATION.md.

const QK: u32 = 4u;
const BLOCK_WORDS: u32 = 2u;

fn dq4(blk: u32, i: u32) -> vec4<f32> {
    let a = W[blk + 2u * i];
    let b = W[blk + 2u * i + 1u];
    let high = vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u);
    return bitcast<vec4<f32>>(high);
}
